"""The Qwen3.5 hybrid backbone (Gated DeltaNet + gated full attention) in plain PyTorch."""
