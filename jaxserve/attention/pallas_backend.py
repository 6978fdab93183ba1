"""Pallas attention backend: the ragged paged attention kernel behind the
same attn_fn signature as reference.paged_attention.

The kernel reads every key, the step's new ones included, back from the paged
cache (the decoder writes them with reference.write_kv first), so this backend
needs block tables wide enough for seq_lens, not just the context
(`needs_full_block_tables` in backends.py).

Under a sharding plan the kernel runs per device inside shard_map (make_attn_fn):
neither Mosaic nor Triton calls can be partitioned by XLA.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention

# jax platform names -> the kernel variant that lowers there
_VARIANTS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "gpu"}


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, platform: str | None = None,
                    kv_head_offset: jax.Array | None = None) -> jax.Array:
    """q [T, N, H], caches [K, B, bs, H] holding k_new/v_new -> out [T, N, H].

    k_new and v_new are unused: the kernel reads them from the cache.
    platform: the platform the step is lowered for (default: JAX's default backend;
    export_check.py lowers for TPU/CUDA from a CPU host). "cpu" runs the Pallas
    interpreter. kv_head_offset: see ragged_paged_attention (tensor-parallel shards
    of a replicated cache).
    """
    del k_new, v_new
    platform = platform or jax.default_backend()
    if platform not in _VARIANTS:
        raise ValueError(f"the Pallas attention backend has no kernel for {platform!r}")
    return ragged_paged_attention(
        q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=platform == "cpu", backend=_VARIANTS[platform],
        kv_head_offset=kv_head_offset)


def make_attn_fn(platform: str | None = None, plan: Any = None) -> Callable[..., jax.Array]:
    """paged_attention for a platform and, with a ShardingPlan, per device under
    shard_map over the plan's mesh (plan.shard_attention)."""
    fn = paged_attention if platform is None else functools.partial(paged_attention,
                                                                     platform=platform)
    return fn if plan is None else plan.shard_attention(fn, head_offset=True)
