"""Load a model from any supported checkpoint format into (config, weights, tokenizer).

    load_model(None)                      the embedded default (SmolLM2-135M-Instruct)
    load_model("dir/")                    HF safetensors dir, or a jaxserve orbax dir
    load_model("model.gguf")              a llama.cpp GGUF file (or a dir holding one)
    load_model(..., quantization="int8")  weights quantized at load (model/quant.py)

Every failure a user can cause raises CheckpointError with a one-line message
(unsupported architectures raise config.UnsupportedModelError; both are ValueErrors).
"""
from __future__ import annotations

from jaxserve.model.loader.convert import convert, convert_main
from jaxserve.model.loader.default_model import default_gguf_path, default_model_path
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.loader.load import QUANTIZATIONS, LoadedModel, detect_format, load_model

__all__ = ["CheckpointError", "LoadedModel", "load_model", "detect_format", "convert",
           "convert_main", "default_model_path", "default_gguf_path", "QUANTIZATIONS"]
