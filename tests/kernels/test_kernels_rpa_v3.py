"""RPA-v3-class TPU kernel (kernel_tpu_v3.py) in the TPU interpreter (DMAs and
semaphores modelled) vs the float64 ref.py, over the same ragged layouts as
test_kernels_ragged_paged_attention.py; the fused KV update vs an XLA scatter;
and Mosaic lowering through jax.export for TPU from this CPU host.

Small `pages_per_chunk` / `block_m` overrides make every layout take several
chunks per tile and several tiles per row, so the double-buffer slot parity, the
prefetch across tile and row boundaries, the fast (unmasked) and masked chunk
paths and the unfetched-page handling all run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import reference
from kernels_pallas.ragged_paged_attention import kernel_tpu_v3 as v3
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref
from test_kernels_ragged_paged_attention import FAST_COMPILE, TOL, cases
from tpu_export import pretend_tpu_v5e

CONFIGS = [
    # kv_heads, group, head_dim, block_size, dtype, window, cap, kwargs
    pytest.param(2, 4, 128, 8, jnp.float32, None, None,
                 {"block_m": 16, "pages_per_chunk": 2}, id="gqa4-bs8-chunk2"),
    pytest.param(4, 1, 128, 8, jnp.float32, None, None,
                 {"block_m": 8, "pages_per_chunk": 1}, id="mha-page-per-chunk"),
    pytest.param(1, 8, 128, 16, jnp.float32, None, None, {}, id="mqa8-default-table"),
    pytest.param(2, 2, 128, 8, jnp.float32, 5, None,
                 {"block_m": 8, "pages_per_chunk": 2}, id="window5"),
    pytest.param(2, 4, 128, 16, jnp.bfloat16, 11, 4.0,
                 {"block_m": 16, "pages_per_chunk": 1}, id="bf16-window-cap"),
    # v6e's decode chunk (1024 tokens) holds far more pages than any table here, as
    # pages of 8 or of 16 alike; the interpreter's program grows with the pages per
    # chunk, so 16-token pages (64 a chunk, not 128) take half its compile
    pytest.param(2, 3, 128, 16, jnp.float32, None, None,
                 {"kind": "decode", "chip": "v6e"}, id="gqa3-decode-kind-v6e"),
]


def _check(case, out, want, dtype):
    atol, rtol = TOL[dtype]
    n = case.num_real_tokens
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)
    np.testing.assert_allclose(np.asarray(out[:n], np.float32), want[:n], atol=atol, rtol=rtol)


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,dtype,window,cap,kwargs", CONFIGS)
def test_v3_matches_ref(kv_heads, group, head_dim, block_size, dtype, window, cap, kwargs):
    scale = head_dim ** -0.5
    fn = jax.jit(functools.partial(v3.ragged_paged_attention_v3, scale=scale,
                                   sliding_window=window, soft_cap=cap, interpret=True,
                                   **kwargs), compiler_options=FAST_COMPILE)
    for i, case in enumerate(cases(hash((kv_heads, group, block_size, 3)) % 2**31,
                                   kv_heads=kv_heads, group=group, head_dim=head_dim,
                                   block_size=block_size, dtype=dtype)):
        want = ragged_paged_attention_ref(*case.kernel_args(), scale=scale,
                                          sliding_window=window, soft_cap=cap)
        try:
            _check(case, fn(*case.kernel_args()), want, dtype)
        except AssertionError as e:
            raise AssertionError(f"layout {i}: q_lens={np.diff(case.cu_q_lens).tolist()} "
                                 f"seq_lens={case.seq_lens.tolist()}") from e


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_kv_update_matches_scatter(dtype):
    """Caches whose new-token slots hold junk: the kernel writes k_new/v_new itself
    (equal, bit for bit, to reference.write_kv's scatter), then attends over them."""
    scale, window = 0.125, 13
    fn = jax.jit(functools.partial(v3.ragged_paged_attention_v3, scale=scale,
                                   sliding_window=window, interpret=True, block_m=16,
                                   pages_per_chunk=2), compiler_options=FAST_COMPILE)
    for case in cases(11, kv_heads=2, group=4, head_dim=128, block_size=8, dtype=dtype):
        K, NB, bs, H = case.k_cache.shape
        slots = jnp.asarray(case.slot_mapping)
        junk_k = case.k_cache.reshape(K, NB * bs, H).at[:, slots].set(77.0, mode="drop")
        junk_v = case.v_cache.reshape(K, NB * bs, H).at[:, slots].set(-5.0, mode="drop")
        want_k, want_v = reference.write_kv(junk_k.reshape(K, NB, bs, H),
                                            junk_v.reshape(K, NB, bs, H),
                                            case.k_new, case.v_new, slots)
        q, _, _, cu, seq, bt = case.kernel_args()
        out, k_cache, v_cache = fn(q, junk_k.reshape(K, NB, bs, H),
                                   junk_v.reshape(K, NB, bs, H), cu, seq, bt,
                                   k_new=case.k_new, v_new=case.v_new)
        np.testing.assert_array_equal(np.asarray(k_cache, np.float32),
                                      np.asarray(want_k, np.float32))
        np.testing.assert_array_equal(np.asarray(v_cache, np.float32),
                                      np.asarray(want_v, np.float32))
        want = ragged_paged_attention_ref(q, want_k, want_v, cu, seq, bt, scale=scale,
                                          sliding_window=window)
        _check(case, out, want, dtype)


def test_v3_kv_head_offset_and_all_padding():
    case = next(cases(5, kv_heads=2, group=4, head_dim=128, block_size=8,
                      dtype=jnp.float32))
    scale, n = 0.125, case.num_real_tokens
    want = ragged_paged_attention_ref(*case.kernel_args(), scale=scale)
    fn = jax.jit(functools.partial(v3.ragged_paged_attention_v3, scale=scale, interpret=True,
                                   block_m=8, pages_per_chunk=2),
                 compiler_options=FAST_COMPILE)
    q, k, v, cu, seq, bt = case.kernel_args()
    out = fn(q[:, 6:8], k, v, cu, seq, bt, kv_head_offset=jnp.int32(1))
    np.testing.assert_allclose(np.asarray(out[:n]), want[:n, 6:8], atol=2e-5, rtol=2e-5)
    empty = fn(q, k, v, jnp.zeros_like(cu), jnp.zeros_like(seq), bt)
    np.testing.assert_array_equal(np.asarray(empty), 0.0)


def test_block_table_and_kinds():
    assert v3.chip_generation("TPU v5 lite") == "v5e"
    assert v3.chip_generation("TPU v6e") == "v6e"
    assert v3.chip_generation("TPU v4") == "default"
    assert [v3.bucket_kind(t, r) for t, r in ((64, 64), (512, 1), (512, 16))] == [
        "decode", "prefill", "mixed"]
    # decode: a tile holds one token's GQA group; chunk = table tokens / page size
    assert v3.block_sizes("decode", "v5e", group=4, kv_heads=8, head_dim=128, block_size=16,
                          itemsize=2) == (16, 32)
    assert v3.block_sizes("decode", "v5e", group=24, kv_heads=1, head_dim=128,
                          block_size=16, itemsize=2)[0] == 32
    # the VMEM cap shortens chunks for wide caches: 64 heads x 256 dims x f32
    _, ppc = v3.block_sizes("decode", "v6e", group=1, kv_heads=64, head_dim=256,
                            block_size=16, itemsize=4)
    assert ppc * 16 * 2 * 2 * 64 * 256 * 4 <= v3.KV_BUFFER_BYTES


@pytest.mark.parametrize("tokens,rows,update,chip,window", [
    (64, 64, False, "v5e", None), (512, 16, True, "v6e", 128), (256, 1, True, "default", None)])
def test_v3_lowers_for_tpu(tokens, rows, update, chip, window, monkeypatch):
    """Pallas -> Mosaic lowering at Llama-3-8B head shapes (not the Mosaic compiler)."""
    from jax import export
    pretend_tpu_v5e(monkeypatch)
    sds = jax.ShapeDtypeStruct
    K, N, H, bs, P, NB = 8, 32, 128, 16, 128, 2048
    args = (sds((tokens, N, H), jnp.bfloat16), sds((K, NB, bs, H), jnp.bfloat16),
            sds((K, NB, bs, H), jnp.bfloat16), sds((rows + 1,), jnp.int32),
            sds((rows,), jnp.int32), sds((rows, P), jnp.int32))
    kw = {}
    if update:
        kw = {"k_new": sds((tokens, K, H), jnp.bfloat16), "v_new": sds((tokens, K, H), jnp.bfloat16)}
    fn = jax.jit(functools.partial(v3.ragged_paged_attention_v3, scale=H ** -0.5, chip=chip,
                                   sliding_window=window, soft_cap=30.0))
    exported = export.export(fn, platforms=["tpu"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("tpu_custom_call")])(*args, **kw)
    assert exported.mlir_module().count("tpu_custom_call") == 1
    assert len(exported.out_avals) == (3 if update else 1)
