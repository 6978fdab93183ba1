"""load_model: any supported checkpoint (see the package doc) into a LoadedModel. Its own
module so the converters (convert.py) can call it without importing the package."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxserve.model.config import ModelConfig
from jaxserve.model.loader.default_model import default_model_path
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.loader.hub import is_repo_id, resolve_repo
from jaxserve.model.loader.orbax_dir import ShardingsFor, is_orbax_dir, load_orbax
from jaxserve.model.loader.safetensors_dir import (has_quantized, is_safetensors_dir,
                                                   load_safetensors_dir)
from jaxserve.model.params import quantize_weights
from jaxserve.model.quant import bytes_by_kind, weight_bytes
from jaxserve.model.tokenizer.load import load_tokenizer
from jaxserve.threads import beside

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("jaxserve")
QUANTIZATIONS = (None, "none", "int8", "fp8", "gguf")


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, Any]          # pytree per params.param_specs(config)
    tokenizer: PreTrainedTokenizerBase | None    # None: loaded with skip_tokenizer
    source: str                      # the path actually read
    format: str                      # "safetensors" | "gguf" | "orbax"
    load_seconds: float


def detect_format(path: Path) -> tuple[str, Path]:
    """-> (format, file or dir to read). Raises CheckpointError if it is no checkpoint."""
    if not path.exists():
        raise CheckpointError(f"model path not found: {path}")
    if path.is_file():
        if _is_gguf(path):
            return "gguf", path
        raise CheckpointError(f"{path}: not a GGUF file (a model is a .gguf file or a "
                              f"checkpoint directory)")
    if is_orbax_dir(path):
        return "orbax", path
    if is_safetensors_dir(path):
        return "safetensors", path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    raise CheckpointError(f"{path}: not a checkpoint directory (expected config.json with "
                          f"model.safetensors[.index.json], one .gguf file, or a jaxserve "
                          f"orbax dir)")


def load_model(model: str | None, dtype: str = "float32", progress: bool = True,
               shardings: ShardingsFor | None = None,
               quantization: str | None = None, skip_tokenizer: bool = False
               ) -> LoadedModel:
    """Load config, weights (as jax arrays of `dtype`) and the fast tokenizer.

    dtype: "float32" | "bfloat16" | "auto" (the checkpoint's own; GGUF: float32).
    shardings: (config) -> a sharding per weight; an orbax checkpoint is restored
    straight into them, each process reading only its own devices' slices (needed
    across hosts; every process must then call this together). Other formats load
    whole on every host and ignore it (the engine cuts their slices).
    skip_tokenizer: load no tokenizer (tokenizer None), for token-id-only use of a
    checkpoint without tokenizer files (vLLM's skip_tokenizer_init).
    quantization: "int8" | "fp8" (per output channel, made here), "gguf" (a GGUF file's
    quantized matrices kept quantized), "none" (float `dtype` weights), or None: "gguf"
    for the default model (its cache holds the file's blocks) and, when the default JAX
    backend is a GPU/TPU, for GGUF files; else "none".
    """
    t0 = time.perf_counter()
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"unknown quantization {quantization!r}; use one of "
                              f"{[q for q in QUANTIZATIONS if q]}")
    if model is None:
        path = default_model_path()
    elif is_repo_id(model):         # "org/name": through the Hugging Face cache
        path = resolve_repo(model)
    else:
        path = Path(model).expanduser()
    fmt, src = detect_format(path)
    stores_blocks = fmt == "safetensors" and has_quantized(src)   # the default's cache
    if quantization == "gguf" and fmt != "gguf" and not stores_blocks:
        raise CheckpointError(f"{src}: --quantization gguf needs a GGUF file (this is a "
                              f"{fmt} checkpoint; use int8 or fp8)")
    if quantization in ("int8", "fp8"):
        shardings = None       # quantized on the host from whole arrays, then placed
    if fmt == "gguf":
        import jax
        # imported here: the gguf package is needed only for GGUF files (the engine
        # imports this package too, e.g. on a device machine without gguf)
        from jaxserve.model.loader.gguf_file import read_gguf
        keep = quantization == "gguf" or (quantization is None
                                          and jax.default_backend() != "cpu")
    # the tokenizer loads beside the weights: importing transformers is mostly pure
    # Python, reading the weights mostly I/O and copies (`jaxserve serve` loads it later,
    # beside the warm-up: server/launch.py)
    tok_job = None if skip_tokenizer else beside(tokenizer_of, str(src), fmt, name="load")
    if fmt == "gguf":
        cfg, weights = read_gguf(src, dtype, progress, keep_quantized=keep)
    elif fmt == "orbax":
        cfg, weights = load_orbax(src, dtype, shardings)
    else:
        cfg, weights = load_safetensors_dir(src, dtype, progress,
                                            keep_quantized=quantization in (None, "gguf"))
    tok = None if tok_job is None else tok_job.result()
    if quantization in ("int8", "fp8"):
        # the embedding / tied head stay float: quantizing them too missed the greedy bar
        # (first 4 tokens equal on 88% of chat prompts, docs/benchmarks.md "Quantization")
        weights = quantize_weights(cfg, weights, quantization, embed=False)
    kinds = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(bytes_by_kind(weights).items()))
    log.info("weights: %.1f MiB resident (%s MiB)", weight_bytes(weights) / 2**20, kinds)
    return LoadedModel(cfg, weights, tok, str(src), fmt, time.perf_counter() - t0)


def tokenizer_of(source: str, fmt: str) -> PreTrainedTokenizerBase:
    """The tokenizer load_model loads for a checkpoint (LoadedModel.source and .format):
    for one loaded with skip_tokenizer whose tokenizer is wanted later or elsewhere."""
    src = Path(source)
    return load_tokenizer(src.parent, src.name) if fmt == "gguf" else load_tokenizer(src)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
