"""How KV block data travels on the transfer stream (transport.py).

    native   the bytes the cache holds, [L, 2, K, n, S, H] in its dtype: exact
    int8     one float32 scale per (layer, k/v, kv head, token), then int8 values:
             scales [L, 2, K, n, S] | values [L, 2, K, n, S, H]

int8 carries a float32 cache in (H + 4) / 4H of the bytes, 0.27 at head_dim 64 (a
bfloat16 one in about 1/2; a SmolLM2 block, 720 KiB in float32, becomes 191 KiB) at the
cost of rounding: each value is off by at most half a step, scale / 2 with scale =
absmax / 127 over its token's head vector: the granularity of the int8 KV cache
(attention/kv_quant.py), whose effect on quality is measured (docs/benchmarks.md,
"Quantization"). One scale per block and head (1/4 of the bytes at any head_dim) was tried
first: on the (chaotic) tiny test model the first completion tried already differed
from its first token on. The decode server asks for int8 (kv-transfer-config
`wire_dtype`); the prefill server answers in the encoding it used, which the header
names, so either side may be older. A cache that is already int8 (or any 1-byte dtype)
always travels natively.
"""
from __future__ import annotations

import math

import numpy as np

WIRES = ("native", "int8")


def choose(wire: str, dtype: np.dtype) -> str:
    """The encoding a server uses for data of `dtype` when `wire` is asked for."""
    return "int8" if wire == "int8" and np.dtype(dtype).itemsize >= 2 else "native"


def encode(data: np.ndarray, wire: str) -> tuple[str, memoryview]:
    """data [L, 2, K, n, S, H] -> (the encoding used, its bytes)."""
    used = choose(wire, data.dtype)
    if used == "native":
        return used, memoryview(np.ascontiguousarray(data)).cast("B")
    x = data.astype(np.float32, copy=False)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return used, memoryview(scale.tobytes() + q.tobytes())


def nbytes(shape: tuple[int, ...], dtype: np.dtype, used: str) -> int:
    """Bytes on the wire for `shape` in encoding `used` (the client checks this)."""
    n = math.prod(shape)
    if used == "native":
        return n * np.dtype(dtype).itemsize
    return math.prod(shape[:-1]) * 4 + n


def decode(payload: bytes, shape: tuple[int, ...], dtype: np.dtype, used: str) -> np.ndarray:
    """Bytes in encoding `used` -> array `shape` of the cache's `dtype`."""
    if used == "native":
        return np.frombuffer(payload, dtype).reshape(shape)
    k = math.prod(shape[:-1])
    scale = np.frombuffer(payload, np.float32, k).reshape(*shape[:-1], 1)
    q = np.frombuffer(payload, np.int8, math.prod(shape), offset=k * 4).reshape(shape)
    return (q.astype(np.float32) * scale).astype(dtype)
