"""LoRA adapters in the PEFT format: a directory with adapter_config.json and
adapter_model.safetensors.

    load_adapter(path, cfg, max_rank) -> Adapter  (host numpy arrays, scale folded in)

Read: r, lora_alpha, use_rslora (scale alpha / sqrt(r) instead of alpha / r),
target_modules (q/k/v/o and gate/up/down projections, as the Llama family, Mistral,
Qwen and Gemma name them), base_model_name_or_path (informational); lora_dropout is a
training setting and is ignored. Refused with an AdapterError naming the problem: a rank
above max_rank, a target jaxserve cannot adapt (embeddings, the head, unknown names),
per-module ranks or alphas (rank_pattern / alpha_pattern), DoRA, shapes that do not
match the base model, a weights file that is not safetensors (adapter_model.bin is
never unpickled), and a file larger than an adapter of max_rank on every target could
be. The file is read once; its SHA-256 identifies the adapter (the prefix cache and the
device slots key on it, so the same weights under two names share both).
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.lora import TARGETS, target_shapes

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 16 << 20


class AdapterError(ValueError):
    """An adapter cannot be loaded; the message is one plain line naming the problem."""


@dataclass(frozen=True, eq=False)
class Adapter:
    """One adapter's weights on the host: weights[(layer, key)] = (A [in, r] float32,
    B [r, out] float32 with the scale folded in); key: the content hash (hex)."""
    path: str
    key: str
    rank: int
    scale: float
    targets: frozenset[str]                     # layer keys (model/lora.py TARGETS values)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(repr=False)
    base_model: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def max_file_bytes(cfg: ModelConfig, max_rank: int) -> int:
    """The largest adapter file accepted: float32 A and B of max_rank on every target of
    every layer, plus room for the header."""
    per_layer = sum(i + o for i, o in target_shapes(cfg).values())
    return cfg.num_layers * per_layer * max_rank * 4 + _MAX_HEADER_BYTES + 8


def read_config(path: Path) -> dict[str, Any]:
    p = path / CONFIG
    if not p.is_file():
        raise AdapterError(f"{path}: not a PEFT adapter directory (no {CONFIG})")
    if p.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterError(f"{p}: larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        conf = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{p}: must be a JSON object")
    return conf


def _target_keys(conf: dict[str, Any]) -> set[str]:
    """The layer keys named by target_modules; AdapterError for anything else."""
    tm = conf.get("target_modules")
    if tm in ("all-linear", None):
        return set(TARGETS.values())
    names = [tm] if isinstance(tm, str) else tm
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise AdapterError(f"target_modules: expected a list of module names, got {tm!r}")
    unknown = sorted(n for n in names if n.rsplit(".", 1)[-1] not in TARGETS)
    if unknown:
        raise AdapterError(f"target_modules {unknown}: not adaptable here (supported: "
                           f"{sorted(TARGETS)})")
    return {TARGETS[n.rsplit(".", 1)[-1]] for n in names}


def _header(data: bytes, p: Path) -> dict[str, Any]:
    if len(data) < 8:
        raise AdapterError(f"{p}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise AdapterError(f"{p}: not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise AdapterError(f"{p}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{p}: not a safetensors file")
    header.pop("__metadata__", None)
    return header


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Read and check a PEFT adapter directory against the base model's config."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"{root}: no such adapter directory")
    conf = read_config(root)
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {conf.get('peft_type')!r}: only LORA adapters")
    if conf.get("use_dora"):
        raise AdapterError("use_dora: DoRA adapters are not supported")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise AdapterError("rank_pattern / alpha_pattern: per-module ranks or alphas are "
                           "not supported")
    r, alpha = conf.get("r"), conf.get("lora_alpha", conf.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"r: expected a positive int, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha: expected a number, got {alpha!r}")
    if r > max_rank:
        raise AdapterError(f"rank {r} is above --max-lora-rank {max_rank}")
    scale = float(alpha) / (float(np.sqrt(r)) if conf.get("use_rslora") else r)
    targets = _target_keys(conf)
    wfile = root / WEIGHTS
    if not wfile.is_file():
        found = sorted(p.name for p in root.glob("adapter_model.*"))
        raise AdapterError(f"{root}: no {WEIGHTS}" + (f" (found {found}: only safetensors "
                                                      f"files are read)" if found else ""))
    size, limit = wfile.stat().st_size, max_file_bytes(cfg, max_rank)
    if size > limit:
        raise AdapterError(f"{wfile}: {size} bytes, more than an adapter of rank "
                           f"{max_rank} on this model can be ({limit})")
    data = wfile.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    header = _header(data, wfile)
    shapes = target_shapes(cfg)
    expect: dict[str, tuple[int, int, str]] = {}    # tensor name -> (layer, key, A|B)
    for name, info in header.items():
        m = _KEY.search(name)
        if m is None:
            raise AdapterError(f"tensor {name!r}: not a LoRA A/B weight of a layer "
                               f"projection (embedding and head adapters are not supported)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise AdapterError(f"tensor {name!r}: unknown target module {module!r}")
        key = TARGETS[module]
        if layer >= cfg.num_layers:
            raise AdapterError(f"tensor {name!r}: layer {layer}, but the base model has "
                               f"{cfg.num_layers} layers")
        if key not in targets:
            raise AdapterError(f"tensor {name!r}: {module} is not in target_modules")
        dtype, shape = info.get("dtype"), info.get("shape")
        if dtype not in _DTYPES:
            raise AdapterError(f"tensor {name!r}: dtype {dtype} (expected F32, F16 or BF16)")
        i, o = shapes[key]
        want = [r, i] if ab == "A" else [o, r]
        if shape != want:
            raise AdapterError(f"tensor {name!r}: shape {shape}, expected {want} for rank "
                               f"{r} on this base model ({module}: {i} -> {o})")
        expect[name] = (layer, key, ab)
    from safetensors import SafetensorError
    from safetensors.flax import load as st_load
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as e:
        raise AdapterError(f"{wfile}: not a valid safetensors file ({e})") from None
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, (layer, key, ab) in expect.items():
        parts.setdefault((layer, key), {})[ab] = np.asarray(tensors[name], np.float32)
    weights = {}
    for (layer, key), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {key}: lora_{'B' if 'A' in ab else 'A'} "
                               f"is missing")
        # PEFT: y = x W^T + scale * x A^T B^T; here x @ w with w [in, out]
        weights[(layer, key)] = (np.ascontiguousarray(ab["A"].T),
                                 np.ascontiguousarray(ab["B"].T * np.float32(scale)))
    if not weights:
        raise AdapterError(f"{wfile}: holds no LoRA weights")
    return Adapter(str(root), digest, r, scale, frozenset(k for _, k in weights), weights,
                   conf.get("base_model_name_or_path"))
