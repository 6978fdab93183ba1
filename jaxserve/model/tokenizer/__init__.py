"""Tokenizers from local checkpoints: HF files (load.py) or GGUF metadata
(gguf.py)."""
