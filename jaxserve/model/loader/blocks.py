"""Quantized matrices (model.quant.QArray) inside a safetensors file.

A QArray named `n` is stored as one plain tensor per part, `n.<part>` (for GGUF Q4_1:
`n.d`, `n.m` float16 and `n.p` uint8, the file's own bytes), and the file's string
metadata lists the quantized names under METADATA_KEY as JSON, {n: {"kind", "shape"}}.
No pickle: safetensors' numpy API reads it back. A reader that wants float weights
dequantizes here, with the same float32 arithmetic as gguf-py (so the values equal those
of the GGUF file dequantized), or through QArray.dequantize for the other kinds.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from jaxserve.model.quant import KINDS, QArray

METADATA_KEY = "jaxserve.quantized"


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """{name: array or QArray} -> (tensors to save, the file's metadata)."""
    tensors: dict[str, np.ndarray] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, a in state.items():
        if isinstance(a, QArray):
            entries[name] = {"kind": a.kind, "shape": list(a.shape)}
            for part, p in a.parts.items():
                tensors[f"{name}.{part}"] = np.ascontiguousarray(np.asarray(p))
        else:
            tensors[name] = np.ascontiguousarray(np.asarray(a))
    clash = sorted(set(entries) & set(tensors))
    if clash:
        raise ValueError(f"tensor name {clash[0]!r} is both a matrix and a part")
    return tensors, {METADATA_KEY: json.dumps(entries, sort_keys=True)}


def entries(metadata: Mapping[str, str] | None) -> dict[str, dict[str, Any]]:
    """The quantized matrices a file's metadata lists ({} for a plain checkpoint)."""
    raw = (metadata or {}).get(METADATA_KEY)
    if not raw:
        return {}
    out = json.loads(raw)
    if not isinstance(out, dict) or any(
            not isinstance(e, dict) or e.get("kind") not in KINDS for e in out.values()):
        raise ValueError(f"malformed {METADATA_KEY} metadata")
    return out


def part_names(name: str, entry: Mapping[str, Any], stored: set[str]) -> dict[str, str]:
    """{part: stored tensor name} of the quantized matrix `name`."""
    prefix = f"{name}."
    return {s[len(prefix):]: s for s in stored
            if s.startswith(prefix) and "." not in s[len(prefix):]}


def _unpack4(p: np.ndarray) -> np.ndarray:
    """uint8 [..., half] -> [..., 2 * half]: low nibbles, then high ones (llama.cpp)."""
    return np.concatenate([p & np.uint8(15), p >> np.uint8(4)], axis=-1)


def dequantize(q: QArray) -> np.ndarray:
    """The float32 [rows, cols] matrix: for q8_0 / q4_0 / q4_1 exactly what gguf-py's
    dequantize gives for the same blocks (float32 products, one rounding each)."""
    parts = {n: np.asarray(p) for n, p in q.parts.items()}
    if q.kind not in ("q8_0", "q4_0", "q4_1"):
        return np.asarray(q.dequantize(np.float32), np.float32)
    d = parts["d"].astype(np.float32)[..., None]
    if q.kind == "q8_0":
        w = parts["q"].astype(np.float32) * d
    elif q.kind == "q4_0":
        w = d * (_unpack4(parts["p"]).astype(np.int8) - np.int8(8)).astype(np.float32)
    else:
        w = d * _unpack4(parts["p"]).astype(np.float32) + parts["m"].astype(np.float32)[..., None]
    return w.reshape(q.shape)
