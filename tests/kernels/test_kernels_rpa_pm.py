"""Page-major TPU kernel (kernel_tpu_pm.py) in the TPU interpreter (DMAs and semaphores
modelled) vs the float64 ref.py: ragged layouts (decodes, chunked prefill after context,
empty rows, padding), page sizes 16/64/128, sliding window, soft cap, int8 KV, TP
slices with one and two kv heads per chip; the overlapped fused write vs a scatter; the
block-drop detector against a deliberately broken kernel; Mosaic lowering for TPU.

One page per chunk on 16-token pages makes a 40-token row take three chunks, so the
triple-buffer slots, the two-deep prefetch across tile and row boundaries and the
row-by-row write overlap all run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.attention import kv_quant as quant
from jaxserve.attention import reference
from kernels_pallas.ragged_paged_attention import drop_check, pm_tuning
from kernels_pallas.ragged_paged_attention import kernel_tpu_pm as pm
from kernels_pallas.ragged_paged_attention.cases import make_case
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref
from test_kernels_ragged_paged_attention import FAST_COMPILE, TOL, cases


def _fn(**kw):
    return jax.jit(functools.partial(pm.ragged_paged_attention_pm, interpret=True, **kw),
                   compiler_options=FAST_COMPILE)


def _check(case, out, want, dtype, cols=slice(None)):
    atol, rtol = TOL[dtype]
    n = case.num_real_tokens
    assert out.dtype == case.q.dtype
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)
    np.testing.assert_allclose(np.asarray(out[:n], np.float32), want[:n, cols], atol=atol,
                               rtol=rtol)
    ok, errs = drop_check.block_drop_check(out[:n], want[:n, cols], case.cu_q_lens,
                                           dtype=jnp.dtype(dtype).name)
    assert ok, errs


CONFIGS = [
    # kv_heads, group, block_size, dtype, window, cap, kwargs
    pytest.param(1, 8, 16, jnp.float32, None, None, {"pages_per_chunk": 1, "block_m": 16},
                 id="tp8-one-head-bs16-page-chunks"),
    pytest.param(2, 4, 16, jnp.bfloat16, 11, 4.0, {"pages_per_chunk": 2, "block_m": 16},
                 id="two-heads-bf16-window-cap"),
    pytest.param(2, 2, 64, jnp.float32, 5, None, {}, id="bs64-window-table"),
    pytest.param(1, 4, 128, jnp.float32, None, None, {"kind": "decode", "chip": "v6e"},
                 id="bs128-decode-kind-v6e"),
]


@pytest.mark.parametrize("kv_heads,group,block_size,dtype,window,cap,kwargs", CONFIGS)
def test_pm_matches_ref(kv_heads, group, block_size, dtype, window, cap, kwargs):
    scale = 128 ** -0.5
    fn = _fn(scale=scale, sliding_window=window, soft_cap=cap, **kwargs)
    layouts = list(cases(hash((kv_heads, group, block_size, 7)) % 2**31, kv_heads=kv_heads,
                         group=group, head_dim=128, block_size=block_size, dtype=dtype))
    if block_size > 16:     # a row fits one page: the random mixes add little
        layouts = layouts[:3]
    for i, case in enumerate(layouts):
        q, k, v, cu, seq, bt = case.kernel_args()
        want = ragged_paged_attention_ref(q, k, v, cu, seq, bt, scale=scale,
                                          sliding_window=window, soft_cap=cap)
        try:
            _check(case, fn(q, pm.to_page_major(k, v), cu, seq, bt), want, dtype)
        except AssertionError as e:
            raise AssertionError(f"layout {i}: q_lens={np.diff(case.cu_q_lens).tolist()} "
                                 f"seq_lens={case.seq_lens.tolist()}") from e
    if kv_heads == 1:       # an all-padding batch (no rows): zeros, no DMA
        empty = fn(q, pm.to_page_major(k, v), jnp.zeros_like(cu), jnp.zeros_like(seq), bt)
        np.testing.assert_array_equal(np.asarray(empty, np.float32), 0.0)


def test_layout_round_trip():
    case = next(cases(1, kv_heads=2, group=1, head_dim=128, block_size=16, dtype=jnp.float32))
    kv = pm.to_page_major(case.k_cache, case.v_cache)
    K, NB, bs, H = case.k_cache.shape
    assert kv.shape == (NB, 2 * K, bs, H)
    np.testing.assert_array_equal(kv[5, 3], case.v_cache[1, 5])     # page 5, head 1's V
    k, v = pm.from_page_major(kv)
    np.testing.assert_array_equal(k, case.k_cache)
    np.testing.assert_array_equal(v, case.v_cache)
    qk = quant.QuantizedKV(*quant.quantize(case.k_cache, "int8"))
    qv = quant.QuantizedKV(*quant.quantize(case.v_cache, "int8"))
    both = pm.to_page_major(qk, qv)
    assert both.values.shape == (NB, 2 * K, bs, H) and both.scales.shape == (NB, 2 * K, bs)
    k2, _ = pm.from_page_major(both)
    np.testing.assert_array_equal(k2.scales, qk.scales)


def _junk_slots(case):
    K, NB, bs, H = case.k_cache.shape
    slots = jnp.asarray(case.slot_mapping)
    junk_k = case.k_cache.reshape(K, NB * bs, H).at[:, slots].set(77.0, mode="drop")
    junk_v = case.v_cache.reshape(K, NB * bs, H).at[:, slots].set(-5.0, mode="drop")
    return junk_k.reshape(K, NB, bs, H), junk_v.reshape(K, NB, bs, H), slots


def test_fused_write_matches_scatter():
    """Caches whose new-token slots hold junk: the kernel writes k_new/v_new row by row
    (bit-equal to reference.write_kv's scatter) while it attends over them, and the
    interpreter's race detector sees no page read while a write to it is in flight."""
    races = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    scale, window, dtype = 0.125, 13, jnp.bfloat16
    fn = jax.jit(functools.partial(
        pm.ragged_paged_attention_pm, scale=scale, sliding_window=window, block_m=16,
        pages_per_chunk=1, interpret=pltpu.InterpretParams(detect_races=True)),
        compiler_options=FAST_COMPILE)
    for case in cases(11, kv_heads=2, group=4, head_dim=128, block_size=16, dtype=dtype):
        junk_k, junk_v, slots = _junk_slots(case)
        want_k, want_v = reference.write_kv(junk_k, junk_v, case.k_new, case.v_new, slots)
        q, _, _, cu, seq, bt = case.kernel_args()
        out, kv = fn(q, pm.to_page_major(junk_k, junk_v), cu, seq, bt,
                     k_new=case.k_new, v_new=case.v_new)
        got_k, got_v = pm.from_page_major(kv)
        assert races.races is not None and not races.races.races_found
        np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32))
        np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
        want = ragged_paged_attention_ref(q, want_k, want_v, cu, seq, bt, scale=scale,
                                          sliding_window=window)
        _check(case, out, want, dtype)


def test_int8_cache_and_fused_write():
    """int8 values + float32 scales, page-major: the fused write stores the same values
    and scales as write_kv's scatter into a quantized cache, and attention over the
    result equals ref.py over the dequantized cache."""
    scale = 128 ** -0.5
    fn = _fn(scale=scale, block_m=16, pages_per_chunk=1, quantize_new=quant.quantize_for_cache)
    for case in list(cases(4, kv_heads=2, group=2, head_dim=128, block_size=16,
                           dtype=jnp.float32))[:2]:
        junk_k, junk_v, slots = _junk_slots(case)
        kq, vq = (quant.QuantizedKV(*quant.quantize(c, "int8")) for c in (junk_k, junk_v))
        want_k, want_v = reference.write_kv(kq, vq, case.k_new, case.v_new, slots)
        q, _, _, cu, seq, bt = case.kernel_args()
        out, kv = fn(q, pm.to_page_major(kq, vq), cu, seq, bt, k_new=case.k_new,
                     v_new=case.v_new)
        got_k, got_v = pm.from_page_major(kv)
        for got, want in ((got_k, want_k), (got_v, want_v)):
            np.testing.assert_array_equal(np.asarray(got.values), np.asarray(want.values))
            np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
        deq = [quant.dequantize(c.values, c.scales) for c in (want_k, want_v)]
        ref = ragged_paged_attention_ref(q, *deq, cu, seq, bt, scale=scale)
        _check(case, out, ref, jnp.float32)


@pytest.mark.parametrize("heads_per_chip", [1, 2])
def test_tp_slices(heads_per_chip):
    """Tensor parallelism as the engine shards it (each chip holds K/TP kv heads and
    their query heads), and one chip reading kv head 1 of a cache it holds whole
    (kv_head_offset)."""
    K, G, scale = 4, 2, 0.125
    case = next(cases(5, kv_heads=K, group=G, head_dim=128, block_size=16, dtype=jnp.float32))
    q, k, v, cu, seq, bt = case.kernel_args()
    want = ragged_paged_attention_ref(q, k, v, cu, seq, bt, scale=scale)
    fn = _fn(scale=scale, block_m=16, pages_per_chunk=1)
    h = heads_per_chip
    cols = slice(h * G, 2 * h * G)                   # chip 1's query heads
    out = fn(q[:, cols], pm.to_page_major(k[h:2 * h], v[h:2 * h]), cu, seq, bt)
    _check(case, out, want, jnp.float32, cols)
    if heads_per_chip == 1:
        out = fn(q[:, cols], pm.to_page_major(k, v), cu, seq, bt, kv_head_offset=jnp.int32(1))
        _check(case, out, want, jnp.float32, cols)


def test_block_drop_detector_catches_a_skipped_page():
    """A kernel that ignores one page of one row passes a bf16-sized allclose on a long
    decode context but fails block_drop_check; on a dominant-page case it fails by O(1);
    the correct kernel passes both."""
    rng = np.random.default_rng(0)
    bs, ctx = 16, 1023
    case = make_case(rng, [1, 1, 3], [ctx, 40, 20], num_tokens=8, num_rows=4,
                     num_kv_heads=1, group=4, head_dim=128, block_size=bs, pages=64,
                     num_blocks=80)
    scale = 128 ** -0.5
    good, bad = _fn(scale=scale), _fn(scale=scale, skip_page=(0, 17))
    for c in (case, drop_check.dominant_page_case(case, [(0, 17), (2, 1)])):
        q, k, v, cu, seq, bt = c.kernel_args()
        want = ragged_paged_attention_ref(q, k, v, cu, seq, bt, scale=scale)
        kv = pm.to_page_major(k, v)
        n = c.num_real_tokens
        ok, errs = drop_check.block_drop_check(good(q, kv, cu, seq, bt)[:n], want[:n], cu,
                                               dtype="float32")
        assert ok, errs
        out = bad(q, kv, cu, seq, bt)[:n]
        ok, errs = drop_check.block_drop_check(out, want[:n], cu, dtype="float32")
        assert not ok and errs[0] > 0.1 and np.all(errs[1:] < 1e-4), errs
        if c is case:       # what a plain bf16-sized allclose would have let through
            np.testing.assert_allclose(np.asarray(out), want[:n], atol=3e-2, rtol=3e-2)
        else:
            assert errs[0] > 1.0, errs


def test_tuning_table():
    # v5e, one bf16 kv head of 128 dims per chip, 16-token pages: 8 KiB pages, 1 MiB
    # decode chunks = 128 pages, capped by the row's table width
    assert pm_tuning.page_bytes(1, 16, 128, 2) == 8 * 1024
    assert pm_tuning.block_sizes("decode", "v5e", group=4, kv_heads=1, head_dim=128,
                                 page_size=16, dtype=jnp.bfloat16, max_pages=512) == (16, 128)
    assert pm_tuning.block_sizes("decode", "v5e", group=4, kv_heads=1, head_dim=128,
                                 page_size=16, dtype="bfloat16", max_pages=64) == (16, 64)
    # v6e, two heads: 2 MiB chunks of 64 KiB pages (bs 64)
    assert pm_tuning.block_sizes("decode", "v6e", group=4, kv_heads=2, head_dim=128,
                                 page_size=64, dtype=jnp.bfloat16, max_pages=512) == (16, 32)
    # prefill: scores [256, chunk] f32 stay under SCORE_BYTES
    bm, ppc = pm_tuning.block_sizes("prefill", "v6e", group=4, kv_heads=1, head_dim=128,
                                    page_size=16, dtype=jnp.bfloat16, max_pages=4096)
    assert bm == 256 and 4 * bm * ppc * 16 <= pm_tuning.SCORE_BYTES
    # VMEM: three chunks of a wide f32 cache stay under the budget
    _, ppc = pm_tuning.block_sizes("decode", "v6e", group=1, kv_heads=16, head_dim=256,
                                   page_size=16, dtype=jnp.float32, max_pages=4096)
    assert 3 * ppc * pm_tuning.page_bytes(16, 16, 256, 4) <= pm_tuning.VMEM_KV_BYTES


@pytest.mark.parametrize("tokens,rows,update,chip,kv_heads,quantized,bs", [
    (64, 64, True, "v5e", 1, False, 32), (512, 16, True, "v6e", 2, False, 64),
    (256, 1, False, "v5e", 1, False, 128), (64, 64, True, "v6e", 2, True, 16)])
def test_pm_lowers_for_tpu(tokens, rows, update, chip, kv_heads, quantized, bs, monkeypatch):
    """Pallas -> Mosaic lowering at Llama-3-8B per-chip head shapes: v5e TP=8 (one kv
    head, 4 query heads per chip), v6e TP=4 (two kv heads, 8 query heads); decode,
    mixed and prefill buckets; pages of 16 to 128 tokens."""
    from jax import export
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry"):
        pytest.skip("jax internals changed: no TPU info registry to patch")
    version = getattr(tpu_info.ChipVersion, "TPU_V6E" if chip == "v6e" else "TPU_V5E", None)
    if version is None:
        pytest.skip(f"this jax has no TPU info for {chip}")
    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                        lambda: tpu_info.get_tpu_info_for_chip(version, 1))
    sds = jax.ShapeDtypeStruct
    K, N, H, NB = kv_heads, 4 * kv_heads, 128, 2048
    P = 2048 // bs
    if quantized:
        kv: object = quant.QuantizedKV(sds((NB, 2 * K, bs, H), jnp.int8),
                                       sds((NB, 2 * K, bs), jnp.float32))
    else:
        kv = sds((NB, 2 * K, bs, H), jnp.bfloat16)
    args = (sds((tokens, N, H), jnp.bfloat16), kv, sds((rows + 1,), jnp.int32),
            sds((rows,), jnp.int32), sds((rows, P), jnp.int32))
    kw = {}
    if update:
        kw = {"k_new": sds((tokens, K, H), jnp.bfloat16), "v_new": sds((tokens, K, H), jnp.bfloat16)}
    fn = jax.jit(functools.partial(pm.ragged_paged_attention_pm, scale=H ** -0.5, chip=chip,
                                   sliding_window=128 if rows == 16 else None, soft_cap=30.0,
                                   quantize_new=quant.quantize_for_cache))
    exported = export.export(fn, platforms=["tpu"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("tpu_custom_call")])(*args, **kw)
    assert exported.mlir_module().count("tpu_custom_call") == 1
    assert len(exported.out_avals) == ((3 if quantized else 2) if update else 1)


def test_memory_model_mirrors_v3_table():
    """jaxserve/tools/kernel_model.py keeps v3's decode chunking as data (jax-free)."""
    from jaxserve.tools import kernel_model
    from kernels_pallas.ragged_paged_attention import kernel_tpu_v3 as v3
    assert {chip: row["decode"][1] for chip, row in v3.BLOCK_TABLE.items()} == \
        kernel_model.V3_DECODE_CHUNK_TOKENS
    assert v3.KV_BUFFER_BYTES == kernel_model.V3_KV_BUFFER_BYTES
