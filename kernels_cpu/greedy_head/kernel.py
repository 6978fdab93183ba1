"""A greedy row's token without reading the whole float32 head: the C++ kernel in head.cc
behind a jnp signature (built and registered with the attention kernel, one library:
../ragged_paged_attention/build.py).

    screen_copy(w [V / 32, D, 32] f32)  -> (w16 [V / 32, D, 32] f16, bound [V] f32), or
                                           None when a weight does not fit float16
    greedy_head(x [M, D], w16, bound, w) -> ids [M] int32: per row, the first index of the
                                           largest logit of x @ (the head w), as
                                           jnp.argmax of small_matmul's packed logits

w is the packed head (small_matmul/kernel.py: pack; the engine's PackedWeight panels).
head.cc says why the ids are exact; bound_v, per vocabulary entry, is
|w_v - w16_v| + gamma (|w_v| + |w16_v|) with gamma = 2 D 2^-24 (twice the float32 dot
products' rounding bound), rounded up.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.ragged_paged_attention import build

F16_MAX = float(np.finfo(np.float16).max)


@jax.jit
def _copy(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    w16 = w.astype(jnp.float16)
    back = w16.astype(jnp.float32)
    P, D, C = w.shape
    err = jnp.sqrt(jnp.sum(jnp.square(w - back), axis=1))
    norms = jnp.sqrt(jnp.sum(jnp.square(w), axis=1)) + jnp.sqrt(jnp.sum(jnp.square(back),
                                                                        axis=1))
    gamma = 2.0 * D * 2.0 ** -24
    # the float32 sums of squares and square roots above are off by ~D u relative: x 1.01
    bound = ((err + gamma * norms) * 1.01).reshape(P * C)
    return w16, bound, jnp.max(jnp.abs(w))


def screen_copy(w: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """The float16 copy and the per-entry bound of a packed float32 head; None when a
    weight is beyond float16's range (or not finite): then no screening."""
    assert w.ndim == 3 and w.dtype == jnp.float32, (w.shape, w.dtype)
    w16, bound, biggest = _copy(w)
    if not bool(jnp.isfinite(biggest)) or float(biggest) >= F16_MAX:
        return None
    return w16, bound


def greedy_head(x: jax.Array, w16: jax.Array, bound: jax.Array, w: jax.Array, *,
                num_threads: int = 0) -> jax.Array:
    """ids [M] int32 (see the module doc); x [M, D] float32."""
    assert x.ndim == 2 and x.dtype == jnp.float32, (x.shape, x.dtype)
    assert w16.dtype == jnp.float16 and w.dtype == jnp.float32 and w16.shape == w.shape
    build.load()
    call = jax.ffi.ffi_call(build.GREEDY_HEAD_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0],), jnp.int32),
                            vmap_method="sequential")
    return call(x, w16, bound, w, num_threads=np.int64(num_threads))
