"""Ragged paged attention on XLA:CPU: the C++ kernel in kernel.cc behind a jnp signature.

Same contract as kernels_pallas.ragged_paged_attention.kernel.ragged_paged_attention
(q [T, N, H]; caches [K, NB, bs, H] that already hold the step's new K/V; rows given by
cu_q_lens, seq_lens and block tables wide enough for seq_lens) -> out [T, N, H].
float32 only (bfloat16 is slower than float32 on CPUs); other dtypes are
computed in float32 and cast back. A quantized cache (jaxserve/attention/kv_quant.py
QuantizedKV: int8 / float8_e4m3fn values + float32 scales [K, NB, bs]) is read as it is
stored and dequantized inside the kernel (the second FFI target).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.ragged_paged_attention import build


def max_threads() -> int:
    """Cap on the threads one call uses; 0 (default): all of XLA's intra-op pool, which
    the kernel schedules its work on (JAXSERVE_CPU_ATTENTION_THREADS overrides)."""
    env = os.environ.get("JAXSERVE_CPU_ATTENTION_THREADS")
    return max(1, int(env)) if env else 0


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           cu_q_lens: jax.Array, seq_lens: jax.Array, block_tables: jax.Array,
                           *, scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           num_threads: int | None = None) -> jax.Array:
    target = build.load()
    f32 = jnp.float32
    if hasattr(k_cache, "scales"):     # a QuantizedKV: values and scales go in as stored
        target = build.QUANT_TARGET
        caches = (k_cache.values, v_cache.values, k_cache.scales.astype(f32),
                  v_cache.scales.astype(f32))
    else:
        caches = (k_cache.astype(f32), v_cache.astype(f32))
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, f32),
                            vmap_method="sequential")
    out = call(q.astype(f32), *caches,
               cu_q_lens.astype(jnp.int32), seq_lens.astype(jnp.int32),
               block_tables.astype(jnp.int32),
               **_attrs(scale, sliding_window, soft_cap, num_threads))
    return out.astype(q.dtype)


def _attrs(scale: float, sliding_window: int | None, soft_cap: float | None,
           num_threads: int | None) -> dict:
    """The FFI attributes every target of kernel.cc takes (0: none / the pool's size)."""
    return dict(scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0),
                num_threads=np.int64(num_threads or max_threads()))


def ragged_paged_attention_write(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                                 k_cache: jax.Array, v_cache: jax.Array,
                                 slot_mapping: jax.Array, cu_q_lens: jax.Array,
                                 seq_lens: jax.Array, block_tables: jax.Array, *, scale: float,
                                 sliding_window: int | None = None,
                                 soft_cap: float | None = None,
                                 num_threads: int | None = None
                                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """ragged_paged_attention on float32 caches that do not hold the step's keys yet:
    k_new / v_new [T, K, H] are written at the flat slots slot_mapping [T] (a slot outside
    the cache: a padding token, skipped) by the same call -> (out, k_cache', v_cache'),
    the caches updated in place (aliased)."""
    build.load()
    f32 = jnp.float32
    assert k_cache.dtype == f32 and v_cache.dtype == f32, (k_cache.dtype, v_cache.dtype)
    call = jax.ffi.ffi_call(
        build.WRITE_TARGET, (jax.ShapeDtypeStruct(q.shape, f32), jax.ShapeDtypeStruct(k_cache.shape, f32),
                 jax.ShapeDtypeStruct(v_cache.shape, f32)),
        vmap_method="sequential", input_output_aliases={3: 1, 4: 2})
    out, k_cache, v_cache = call(
        q.astype(f32), k_new.astype(f32), v_new.astype(f32), k_cache, v_cache,
        slot_mapping.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
        seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
        **_attrs(scale, sliding_window, soft_cap, num_threads))
    return out.astype(q.dtype), k_cache, v_cache
