"""HF checkpoint directories: config.json + model.safetensors (or sharded + index).

Tensors are read one at a time through safetensors' numpy API (no pickle, no torch).
numpy has no bfloat16, so bf16 tensors go through safetensors' flax API instead.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxserve.model.config import ModelConfig
from jaxserve.model.gemma import text_tensor_name
from jaxserve.model.loader.assemble import assemble_weights, resolve_dtype
from jaxserve.model.loader import blocks
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.quant import QArray

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_safetensors_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / SINGLE).is_file() or (path / INDEX).is_file())


def read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return d


def read_config(path: Path) -> tuple[ModelConfig, str | None]:
    """ModelConfig (eos ids merged with generation_config.json) and the stored dtype."""
    hf = read_json(path / "config.json")
    try:
        cfg = ModelConfig.from_hf_dict(hf)
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: missing key {e}") from e
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = read_json(gen).get("eos_token_id")
        eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *(int(e) for e in eos)]))
        cfg = cfg.replace(eos_token_ids=merged)
    return cfg, hf.get("dtype") or hf.get("torch_dtype")


def shard_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{path / INDEX}: shard {f.name} not found")
        return files
    return [path / SINGLE]


def load_safetensors_weights(path: Path, cfg: ModelConfig, dtype: Any,
                             progress: bool = True,
                             rename: Callable[[str], str | None] | None = None,
                             keep_quantized: bool = False) -> dict[str, Any]:
    """rename: checkpoint name -> the name params expects, or None to skip the tensor
    (a multimodal Gemma 3's language model: gemma.text_tensor_name). Quantized matrices
    (loader/blocks.py) load as QArrays with keep_quantized, else dequantized."""
    with ExitStack() as stack:
        where: dict[str, Any] = {}
        for f in shard_files(path):
            try:
                h = stack.enter_context(safe_open(str(f), framework="numpy"))
                quantized = blocks.entries(h.metadata())
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f}: not a valid safetensors file "
                                      f"(truncated or corrupt: {e})") from e
            stored_names = set(h.keys())
            for qname, entry in quantized.items():
                parts = blocks.part_names(qname, entry, stored_names)
                stored_names -= set(parts.values())
                name = rename(qname) if rename else qname
                if name is not None:
                    where[name] = (f, h, QArray(entry["kind"], parts, entry["shape"], dtype))
            for stored in stored_names:
                name = rename(stored) if rename else stored
                if name is None:
                    continue
                if name in where:
                    raise CheckpointError(f"{path}: tensor {name!r} appears in two shards")
                where[name] = (f, h, stored)

        def get(key: str) -> np.ndarray | QArray:
            f, h, name = where[key]
            if isinstance(name, QArray):       # parts: {part: stored name}
                q = name.map_parts(lambda _, stored: h.get_tensor(stored))
                return q if keep_quantized else blocks.dequantize(q)
            if h.get_slice(name).get_dtype() == "BF16":
                with safe_open(str(f), framework="flax") as hf:
                    return np.asarray(hf.get_tensor(name))
            return h.get_tensor(name)

        return assemble_weights(cfg, where.keys(), get, dtype, str(path), progress)


def load_safetensors_dir(path: Path, dtype: str, progress: bool = True,
                         keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    cfg, stored = read_config(path)
    # Gemma 3 with a vision tower: its language model only (the tower is not loaded)
    rename = text_tensor_name if "text_config" in read_json(path / "config.json") else None
    return cfg, load_safetensors_weights(path, cfg, resolve_dtype(dtype, stored), progress,
                                         rename, keep_quantized)


def has_quantized(path: Path) -> bool:
    """Whether a safetensors directory stores quantized matrices (loader/blocks.py)."""
    try:
        with safe_open(str(shard_files(path)[0]), framework="numpy") as h:
            return bool(blocks.entries(h.metadata()))
    except (SafetensorError, OSError, ValueError):
        return False


def save_safetensors_dir(dst: Path, cfg: ModelConfig, weights: dict[str, Any],
                         keep_quantized: bool = False) -> None:
    """Write the weights as an HF checkpoint directory (config.json and one
    model.safetensors, HF tensor names; the tokenizer is saved by the caller): float32,
    or with keep_quantized the QArrays as their parts (loader/blocks.py). Plain files:
    any process may write it (no collective save, unlike orbax)."""
    from safetensors.numpy import save_file

    from jaxserve.model.export import to_hf_state_dict
    state = to_hf_state_dict(cfg, weights, keep_quantized)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)       # the embedding is the head
    tensors, metadata = blocks.flatten(state)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / SINGLE), metadata=metadata)
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
