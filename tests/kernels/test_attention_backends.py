"""Attention backend selection, and the Pallas attn_fn against the reference one."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import backends, cpu_backend, pallas_backend, reference
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.cases import make_case


def test_named_backends():
    ref = backends.get_attention_backend("reference")
    assert ref.attn_fn is reference.paged_attention and not ref.needs_full_block_tables
    pallas = backends.get_attention_backend("pallas")
    assert pallas.attn_fn is pallas_backend.paged_attention and pallas.needs_full_block_tables
    cpu = backends.get_attention_backend("cpu")
    assert cpu.attn_fn is cpu_backend.paged_attention and cpu.needs_full_block_tables
    assert cpu.single_table_width and not pallas.single_table_width


def test_default_backend_by_platform():
    assert jax.default_backend() == "cpu"
    assert backends.get_attention_backend(None).name == "cpu"
    assert backends.default_backend_name("gpu") == "pallas"
    assert backends.default_backend_name("tpu") == "pallas"
    assert backends.default_backend_name("cpu") == "cpu"
    # sharded steps keep the jnp reference (the kernel has no partitioning rule)
    assert backends.get_attention_backend(None, sharded=True).name == "reference"


def test_cpu_kernel_falls_back_without_compiler(monkeypatch, caplog):
    from kernels_cpu.ragged_paged_attention import build

    def unavailable(*a, **k):
        raise build.KernelUnavailable("no C++ compiler found")
    monkeypatch.setattr(build, "load", unavailable)
    assert backends.default_backend_name("cpu") == "reference"
    assert "no C++ compiler" in caplog.text
    with pytest.raises(build.KernelUnavailable):
        backends.get_attention_backend("cpu")


def test_unknown_backend_names_itself():
    with pytest.raises(ValueError, match="flash3"):
        backends.get_attention_backend("flash3")


@pytest.mark.parametrize("other", ["pallas", "cpu"])
@pytest.mark.parametrize("window", [None, 6])
def test_kernel_attn_fns_match_reference(window, other):
    """Same call the decoder makes, same metadata, both backends agree."""
    case = make_case(np.random.default_rng(7), [3, 1, 6], [9, 17, 0], num_tokens=12,
                     num_rows=4, num_kv_heads=2, group=2, head_dim=64, block_size=8,
                     pages=3, num_blocks=16)
    args = (case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, AttentionMetadata(**case.metadata_fields()))
    outs = [jax.jit(functools.partial(b.attn_fn, scale=0.125, sliding_window=window))(*args)
            for b in map(backends.get_attention_backend, ("reference", other))]
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]   # a KV-writing attn_fn
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(outs[1][:n]), np.asarray(outs[0][:n]),
                               atol=2e-5, rtol=2e-5)
    assert bool(jnp.isfinite(outs[1]).all())
