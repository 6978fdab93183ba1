"""The reference backend's tiled context gather (prefill-sized buckets) computes exactly
what the per-token gather computes, and both match the independent float64 reference."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import reference
from jaxserve.attention.tiles import build_query_tiles
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.cases import make_case
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref


@pytest.mark.parametrize("q_lens, ctx_lens, window", [
    ([37, 1, 1, 20], [5, 30, 0, 17], None),       # chunks that split blocks + decodes
    ([1, 50, 3], [40, 0, 9], 12),                 # sliding window across the context edge
    ([16, 16, 16, 16], [16, 0, 33, 64], None),    # chunks on tile boundaries
])
def test_tiled_equals_per_token_and_ref(q_lens, ctx_lens, window):
    rng = np.random.default_rng(0)
    T, R = 80, 6
    case = make_case(rng, q_lens, ctx_lens, num_tokens=T, num_rows=R, num_kv_heads=2, group=3,
                     head_dim=16, block_size=8, pages=16, num_blocks=64)
    md = AttentionMetadata(**case.metadata_fields())
    tr, tt, ts = build_query_tiles(case.cu_q_lens, len(q_lens), T, R)
    tiled = dataclasses.replace(md, tile_rows=jnp.asarray(tr), tile_tokens=jnp.asarray(tt),
                                token_tile_slot=jnp.asarray(ts))
    kw = dict(scale=0.25, sliding_window=window)
    a = reference.paged_attention(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache,
                                  md, **kw)
    b = reference.paged_attention(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache,
                                  tiled, **kw)
    n = int(case.cu_q_lens[len(q_lens)])
    np.testing.assert_allclose(np.asarray(a)[:n], np.asarray(b)[:n], atol=2e-5, rtol=2e-5)
    ref = ragged_paged_attention_ref(*case.kernel_args(), **kw)
    np.testing.assert_allclose(np.asarray(b)[:n], np.asarray(ref)[:n], atol=2e-5, rtol=2e-5)
