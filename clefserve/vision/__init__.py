"""Images in Clef records: safe decoding, Qwen's preprocessing, the Qwen3.5 vision tower, M-RoPE positions.

Nothing here fetches a URL or reads a file named by a request (see ``decode``).
"""
