"""The references the kernels are tested against: dequantize the whole matrix, then dot."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def int8_matmul_ref(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] . (q [N, K] int8 * scale [N, None]).T -> [M, N] in x's dtype, float32
    accumulation."""
    w = q.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    out = jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def dequantize_blocks(kind: str, parts: dict) -> jax.Array:
    """W [N, K] float32 from GGUF block parts (blocks.py's table), written out in K
    order the way gguf-py dequantizes a row."""
    f32 = jnp.float32
    if kind == "q8_0":
        q = parts["q"].astype(f32)
        w = q * parts["d"].astype(f32)[..., None]
        return w.reshape(q.shape[0], -1)
    p = parts["p"]
    lo, hi = (p & 15).astype(f32), (p >> 4).astype(f32)
    vals = jnp.concatenate([lo, hi], axis=-1)          # group: values j, then j + half
    n = p.shape[0]
    if kind in ("q4_0", "q4_1"):
        d = parts["d"].astype(f32)[..., None]
        w = d * (vals - 8.0) if kind == "q4_0" else d * vals + parts["m"].astype(f32)[..., None]
        return w.reshape(n, -1)
    sub = vals.reshape(n, -1, 32)                      # q4_k: 32-value sub-blocks
    d = jnp.repeat(parts["d"].astype(f32), 8, axis=1) * parts["sc"].astype(f32)
    dmin = jnp.repeat(parts["dmin"].astype(f32), 8, axis=1) * parts["mn"].astype(f32)
    return (d[..., None] * sub - dmin[..., None]).reshape(n, -1)


def block_matmul_ref(x: jax.Array, kind: str, parts: dict) -> jax.Array:
    """x [M, K] . W.T -> [M, N] in x's dtype: W dequantized in float32, cast to x's dtype
    (as the model's XLA path does), float32 accumulation."""
    w = dequantize_blocks(kind, parts).astype(x.dtype).astype(jnp.float32)
    out = jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)
