"""Load a model from any supported checkpoint format into (config, weights, tokenizer).

    load.load_model(None)                      the embedded default (SmolLM2-135M-Instruct)
    load.load_model("dir/")                    HF safetensors dir, or a jaxserve orbax dir
    load.load_model("model.gguf")              a llama.cpp GGUF file (or a dir holding one)
    load.load_model(..., quantization="int8")  weights quantized at load (model/quant.py)
    convert.convert(...)                       a checkpoint to the start-up cache's form

Every failure a user can cause raises CheckpointError with a one-line message
(unsupported architectures raise config.UnsupportedModelError; both are ValueErrors).

The package itself imports only its errors: the tokenizer (model/tokenizer), which the
loader uses, reads the GGUF reader and the errors from here, and a package that imported
its loader on import would close that circle.
"""
from __future__ import annotations

from jaxserve.model.loader.errors import CheckpointError

__all__ = ["CheckpointError"]
