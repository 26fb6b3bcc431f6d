"""clef-serve: an inference server for System One decision models on hybrid Qwen3.5 backbones."""

__version__ = "0.1.0"
