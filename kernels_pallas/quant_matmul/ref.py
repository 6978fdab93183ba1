"""The reference the kernel is tested against: dequantize the whole matrix, then dot."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def int8_matmul_ref(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] . (q [N, K] int8 * scale [N, None]).T -> [M, N] in x's dtype, float32
    accumulation."""
    w = q.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    out = jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)
