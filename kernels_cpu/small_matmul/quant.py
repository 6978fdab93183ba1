"""y = x @ W for a few rows of x, W quantized: the C++ kernel in quant.cc behind a jnp
signature (built and registered with the other CPU kernels, one library: build.py).

    pack_quant(kind, parts, (N, K)) -> (q, scale, offset)   numpy, once at engine start
    quant_matmul_many(x [M, K], [(q, scale, offset), ...]) -> [x @ W_1, ...] (1-4 weights)
    dequantize_panels(q, scale, offset) -> W [K, N] float32  (numpy: tests, checks)

`kind` and `parts` are a quantized matrix M [N, K] in the engine's QArray form (rows =
output channels, as GGUF and Hugging Face store it; x @ M.T is the product):

    int8   q int8 [N, K], scale f32 [N]                  -> 8-bit, one f32 scale per column
    q8_0   q int8 [N, K/32, 32], d f16 [N, K/32]         -> 8-bit, f16 scale per 32 rows
    q4_0   p uint8 [N, K/32, 16], d                      -> 4-bit, f16 scale and -8 d
    q4_1   p, d, m f16 [N, K/32]                         -> 4-bit, f16 scale and offset
    q4_k   p uint8 [N, K/64, 32], d/dmin f16 [N, K/256], sc/mn uint8 [N, K/32]
                                                         -> 4-bit, f32 d*sc and -dmin*mn

The panels (quant.cc's layout) hold the same values and scales: Q8_0 and Q4_0/Q4_1
panels take the file's bytes per weight (Q4_0: 20 instead of 18 bytes per 32, its
offset stored), Q4_K 24 instead of 18 (its products d * sc do not fit float16).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.ragged_paged_attention import build

PANEL = 32
KINDS = ("int8", "q8_0", "q4_0", "q4_1", "q4_k")
MAX_MANY = 4

Packed = tuple[Any, Any, Any]       # (q, scale, offset): the kernel's three buffers


def _nibbles(p: np.ndarray) -> np.ndarray:
    """uint8 [..., half] -> [..., 2 * half]: low nibbles first, then high ones (GGUF)."""
    return np.concatenate([p & 15, p >> 4], axis=-1)


def _panels(v: np.ndarray) -> np.ndarray:
    """[N, X] -> [N / 32, X, 32]: panel p holds rows 32p..32p+31 of v as its columns."""
    N, X = v.shape
    return np.ascontiguousarray(v.reshape(N // PANEL, PANEL, X).transpose(0, 2, 1))


def _pairs(v: np.ndarray) -> np.ndarray:
    """4-bit values [N, K] (0..15) -> panels [N / 32, K / 2, 32]: rows 2j, 2j + 1 of a
    panel in byte j's low and high nibble."""
    pv = _panels(v.astype(np.uint8))
    return np.ascontiguousarray(pv[:, 0::2, :] | (pv[:, 1::2, :] << 4))


def packable(kind: str, shape: tuple[int, int]) -> bool:
    N, K = shape
    return kind in KINDS and N % PANEL == 0 and K > 0 and (kind == "int8" or K % 32 == 0)


def pack_quant(kind: str, parts: dict[str, Any], shape: tuple[int, int]) -> Packed:
    """The kernel's panels of a quantized matrix [N, K] (see the module doc), numpy."""
    assert packable(kind, shape), (kind, shape)
    N, K = shape
    a = {n: np.asarray(v) for n, v in parts.items()}
    none16 = np.zeros((0,), np.float16)
    if kind == "int8":
        return (_panels(a["q"].reshape(N, K)), _panels(a["scale"].astype(np.float32)[:, None]),
                np.zeros((0,), np.float32))
    d = a["d"].astype(np.float16)
    if kind == "q8_0":
        return _panels(a["q"].reshape(N, K)), _panels(d), none16
    if kind == "q4_0":
        return (_pairs(_nibbles(a["p"]).reshape(N, K)), _panels(d),
                _panels((d.astype(np.float32) * -8.0).astype(np.float16)))
    if kind == "q4_1":
        return _pairs(_nibbles(a["p"]).reshape(N, K)), _panels(d), _panels(a["m"].astype(np.float16))
    # q4_k: 64-value groups hold two 32-value sub-blocks (low nibbles, then high ones)
    sub = a["sc"].shape[-1] // a["d"].shape[-1]
    scale = np.repeat(a["d"].astype(np.float32), sub, axis=-1) * a["sc"].astype(np.float32)
    off = -np.repeat(a["dmin"].astype(np.float32), sub, axis=-1) * a["mn"].astype(np.float32)
    return _pairs(_nibbles(a["p"]).reshape(N, K)), _panels(scale), _panels(off)


def dequantize_panels(q: Any, scale: Any, offset: Any) -> np.ndarray:
    """The float32 matrix W [K, N] the panels stand for (x @ W is the kernel's product)."""
    q, scale, offset = np.asarray(q), np.asarray(scale), np.asarray(offset)
    P, _, C = q.shape
    if q.dtype == np.uint8:
        v = np.stack([q & 15, q >> 4], axis=2).reshape(P, -1, C).astype(np.float32)
    else:
        v = q.astype(np.float32)
    K = v.shape[1]
    B = K // scale.shape[1]
    w = v * np.repeat(scale.astype(np.float32), B, axis=1)
    if offset.size:
        w = w + np.repeat(offset.astype(np.float32), B, axis=1)
    return np.ascontiguousarray(w.transpose(1, 0, 2).reshape(K, P * C))


def value_bits(q: Any) -> int:
    return 4 if q.dtype == jnp.uint8 else 8


def quant_matmul_many(x: jax.Array, ws: list[Packed], *, num_threads: int = 0,
                      int8_acts: bool = False, narrow_acts: bool = False) -> list[jax.Array]:
    """[x @ W_i for each packed weight] in one kernel call; x [M, K] float32. int8_acts:
    integer dot products where the build and CPU have them (quant.cc; else the float
    path): 4-bit panels up to 8 rows with x quantized to int8 per 32 values, 8-bit panels
    past 8 rows (AVX512-VNNI) with x in 16 bits, or in 8 with narrow_acts."""
    assert x.ndim == 2 and x.dtype == jnp.float32 and 1 <= len(ws) <= MAX_MANY
    K = x.shape[1]
    for q, scale, _ in ws:
        assert q.ndim == 3 and q.shape[2] == PANEL, q.shape
        assert q.shape[1] * (2 if value_bits(q) == 4 else 1) == K, (q.shape, K)
        assert scale.shape[0] == q.shape[0], (scale.shape, q.shape)
    build.load()
    outs = [jax.ShapeDtypeStruct((x.shape[0], q.shape[0] * PANEL), jnp.float32)
            for q, _, _ in ws]
    call = jax.ffi.ffi_call(build.QUANT_MATMUL_TARGET, outs, vmap_method="sequential")
    flat = [a for w in ws for a in w]
    return list(call(x, *flat, num_threads=np.int64(num_threads),
                     int8_acts=np.bool_(int8_acts), narrow_acts=np.bool_(narrow_acts)))
