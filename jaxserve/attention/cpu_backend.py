"""CPU attention backend: the C++ ragged paged attention kernel (kernels_cpu) behind
the decoder's attn_fn signature.

It writes the step's new keys and values into the paged caches itself (a
KVWritingAttention: one kernel call instead of XLA's scatter per cache, whose thunks
cost ~7% of a batch-1 decode step on the default model) and reads every key, the new
ones included, back from the cache, so block tables must cover seq_lens. Quantized and
non-float32 caches are written by the decoder's scatter (reference.write_kv) first.
The kernel walks only each row's own blocks, so the block-table width costs nothing
and one width is compiled (`single_table_width` in backends.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.attention import reference
from jaxserve.attention.kv_writing import KVWritingAttention
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.attention import kv_quant as quant
from kernels_cpu.ragged_paged_attention.kernel import (ragged_paged_attention,
                                                       ragged_paged_attention_write)


def _paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                     k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                     *, scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, N, H], k_new / v_new [T, K, H], caches [K, B, bs, H] -> (out [T, N, H],
    the caches with k_new / v_new written at md.slot_mapping)."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if (not quant.is_quantized(k_cache) and k_cache.dtype == jnp.float32
            and v_cache.dtype == jnp.float32):
        return ragged_paged_attention_write(q, k_new, v_new, k_cache, v_cache,
                                            md.slot_mapping, md.query_start_loc,
                                            md.seq_lens, md.block_tables, **kw)
    k_cache, v_cache = reference.write_kv(k_cache, v_cache, k_new, v_new, md.slot_mapping)
    out = ragged_paged_attention(q, k_cache, v_cache, md.query_start_loc, md.seq_lens,
                                 md.block_tables, **kw)
    return out, k_cache, v_cache


paged_attention = KVWritingAttention(_paged_attention)
