"""CPU attention backend: the C++ ragged paged attention kernel (kernels_cpu) behind
the same attn_fn signature as reference.paged_attention.

Like the Pallas backend it reads every key, the step's new ones included, back from
the paged cache (the decoder writes them first), so block tables must cover seq_lens.
It walks only each row's own blocks, so the block-table width costs nothing and one
width is compiled (`single_table_width` in backends.py).
"""
from __future__ import annotations

import jax

from jaxserve.attention.metadata import AttentionMetadata
from kernels_cpu.ragged_paged_attention.kernel import ragged_paged_attention


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """q [T, N, H], caches [K, B, bs, H] holding k_new/v_new -> out [T, N, H]."""
    del k_new, v_new
    return ragged_paged_attention(q, k_cache, v_cache, md.query_start_loc, md.seq_lens,
                                  md.block_tables, scale=scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap)
