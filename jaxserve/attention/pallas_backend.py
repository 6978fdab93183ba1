"""Pallas attention backend: the ragged paged attention kernel behind the
same attn_fn signature as reference.paged_attention.

The kernel reads every key, the step's new ones included, back from the paged
cache (the decoder writes them with reference.write_kv first), so this backend
needs block tables wide enough for seq_lens, not just the context
(`needs_full_block_tables` in backends.py).
"""
from __future__ import annotations

import jax

from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """q [T, N, H], caches [K, B, bs, H] holding k_new/v_new -> out [T, N, H].

    k_new and v_new are unused: the kernel reads them from the cache.
    Runs the Pallas interpreter when JAX's default backend is the CPU.
    """
    del k_new, v_new
    return ragged_paged_attention(
        q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=jax.default_backend() == "cpu")
