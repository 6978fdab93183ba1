"""Attention backend selection, and the Pallas attn_fn against the reference one."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import backends, pallas_backend, reference
from kernels_pallas.ragged_paged_attention.cases import make_case


def test_named_backends():
    ref = backends.get_attention_backend("reference")
    assert ref.attn_fn is reference.paged_attention and not ref.needs_full_block_tables
    pallas = backends.get_attention_backend("pallas")
    assert pallas.attn_fn is pallas_backend.paged_attention and pallas.needs_full_block_tables


def test_default_backend_by_platform():
    assert jax.default_backend() == "cpu"
    assert backends.get_attention_backend(None).name == "reference"
    assert backends.default_backend_name("gpu") == "pallas"
    assert backends.default_backend_name("tpu") == "pallas"
    assert backends.default_backend_name("cpu") == "reference"


def test_unknown_backend_names_itself():
    with pytest.raises(ValueError, match="flash3"):
        backends.get_attention_backend("flash3")


@pytest.mark.parametrize("window", [None, 6])
def test_pallas_attn_fn_matches_reference(window):
    """Same call the decoder makes, same metadata, both backends agree."""
    case = make_case(np.random.default_rng(7), [3, 1, 6], [9, 17, 0], num_tokens=12,
                     num_rows=4, num_kv_heads=2, group=2, head_dim=64, block_size=8,
                     pages=3, num_blocks=16)
    args = (case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, case.metadata())
    outs = [jax.jit(functools.partial(b.attn_fn, scale=0.125, sliding_window=window))(*args)
            for b in map(backends.get_attention_backend, ("reference", "pallas"))]
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(outs[1][:n]), np.asarray(outs[0][:n]),
                               atol=2e-5, rtol=2e-5)
    assert bool(jnp.isfinite(outs[1]).all())
