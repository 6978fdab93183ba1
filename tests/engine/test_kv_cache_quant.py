"""Quantized KV cache (--kv-cache-dtype int8|fp8, jaxserve/attention/kv_quant.py): the
round trip's error bound, every attention backend over a quantized cache against the
float64 ref.py over the same dequantized values (tight) and over the float cache
(loose), the write path, and the engine end to end."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import reference
from jaxserve.attention import kv_quant as quant
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.cases import make_case
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref
from engine_utils import core_greedy
from tpu_export import pretend_tpu_v5e

KINDS = ("int8", "fp8")
# |x - dequant(quant(x))| <= bound * max|x| of the (token, head) vector: half an int8 step
# (1/127 of the max, halved); e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the
# value, and values below the smallest normal (2^-6 of 448 scale units) round to 1/512
# steps of the scale.
BOUND = {"int8": 0.5 / 127, "fp8": 2.0 ** -4}
# attention over the quantized cache vs over the float cache it came from (outputs are
# ~unit scale: standard normal values): observed max errors ~0.02 (int8), ~0.15 (fp8)
LOOSE = {"int8": 0.05, "fp8": 0.3}
TIGHT = 2e-5


# ---- the engine ---------------------------------------------------------------------------
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              token_buckets=[8, 32], num_kv_blocks=12)


def _engine(kv_cache_dtype, warmup=None, **kw):
    from engine_utils import tiny_config, tiny_weights
    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    cfg = tiny_config()
    args = EngineArgs(**{**ENGINE, **kw}, kv_cache_dtype=kv_cache_dtype)
    more = {} if warmup is None else {"warmup": warmup}
    return EngineCore(args, cfg, tiny_weights(cfg), progress=False, **more)


def _greedy(engine, prompts, n=12):
    return core_greedy(engine, prompts, n)


@pytest.fixture(scope="module")
def prompts():
    from engine_utils import random_prompts
    # 10 prompts of up to 60 tokens in 12 blocks of 16: chunked prefill and preemption
    return random_prompts(10, 128, 5, 60, seed=11)


@pytest.fixture(scope="module")
def float_tokens(prompts):
    # a reference: it compiles only the steps it runs (it counts no compiles)
    return _greedy(_engine("auto", attention_backend="reference", warmup=False), prompts)


@pytest.mark.warmup
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_engine_greedy_backends_and_step_modes_agree(kind, prompts, float_tokens):
    """int8/fp8 KV through the whole engine (chunked prefill, preemption, prefix cache):
    the jnp reference and the C++ kernel, layerwise and fused, generate the same tokens
    (they read the same quantized values), close to the float cache's tokens, and no
    step recompiles after warm-up."""
    from kernels_cpu.ragged_paged_attention import build
    # the reference compiles only the steps it runs: only the kernel engines below count
    # compiles after warm-up
    ref_engine = _engine(kind, attention_backend="reference", warmup=False)
    assert quant.is_quantized(ref_engine.runner.kv[0][0])
    assert ref_engine.runner.kv[0][0].dtype == quant.STORAGE[kind]
    want = _greedy(ref_engine, prompts)
    assert ref_engine.scheduler.num_preemptions > 0
    backends = ["cpu"] if build.available() else []
    for backend in backends:
        for mode in ("layerwise", "fused"):
            eng = _engine(kind, attention_backend=backend, step_mode=mode)
            warm = eng.num_compiles
            assert _greedy(eng, prompts) == want, (backend, mode)
            assert eng.num_compiles == warm, (backend, mode)
    # vs the float cache: the same model with KV rounding noise. Loose: this random tiny
    # model (head_dim 16, large init) is chaotic, fp8's 3-bit mantissa flips later tokens
    # (observed mean common prefix 4.8 of 12 for fp8, >= 6 for int8); the quality bar on
    # the real model is benchmarks/quality.py's (docs/benchmarks.md)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(want, float_tokens)]
    if kind == "int8":
        assert np.mean(agree) >= 0.5 * len(want[0]), agree
    assert np.mean([a > 0 for a in agree]) >= 0.7, agree       # first tokens


@pytest.mark.slow
def test_pool_holds_more_blocks_for_the_same_memory():
    """--kv-cache-memory sizes the pool: int8 values + f32 scales per (token, head) vs
    float32 values (tiny model: head_dim 16, so 16 + 4 vs 64 bytes)."""
    from jaxserve.worker.kv_device import bytes_per_block
    from engine_utils import tiny_config
    cfg = tiny_config()
    f32 = bytes_per_block(cfg, 16, jnp.float32)
    q8 = bytes_per_block(cfg, 16, jnp.float32, kv_cache_dtype="int8")
    assert f32 == 2 * 2 * 2 * 16 * 16 * 4 and q8 == 2 * 2 * 2 * 16 * (16 + 4)
    budget = 100 * f32
    blocks = {}
    for kind in ("auto", "int8"):
        eng = _engine(kind, num_kv_blocks=None, kv_cache_memory=budget, max_num_seqs=2,
                      token_buckets=[8], attention_backend="reference")
        blocks[kind] = eng.kv_manager.num_blocks
        kv = eng.runner.kv
        nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(kv))
        assert nbytes == blocks[kind] * bytes_per_block(cfg, 16, jnp.float32,
                                                        kv_cache_dtype=kind)
    assert blocks["auto"] == 100 and blocks["int8"] == budget // q8


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_bound(kind):
    rng = np.random.default_rng(0)
    # per-vector magnitudes over 6 orders, plus an all-zero vector (scale 0 must not NaN)
    x = rng.standard_normal((64, 4, 128)).astype(np.float32)
    x *= 10.0 ** rng.uniform(-3, 3, (64, 4, 1)).astype(np.float32)
    x[3, 1] = 0.0
    values, scales = quant.quantize(jnp.asarray(x), kind)
    assert values.dtype == quant.STORAGE[kind] and scales.shape == (64, 4)
    y = np.asarray(quant.dequantize(values, scales))
    amax = np.abs(x).max(-1, keepdims=True)
    err = np.abs(y - x)
    if kind == "int8":
        assert (err <= BOUND[kind] * amax * (1 + 1e-5) + 1e-30).all()
    else:
        # normal range: relative bound; subnormals: absolute step of scale / 512
        step = amax / 448.0 * 2.0 ** -9
        assert (err <= np.maximum(BOUND[kind] * np.abs(x), step) * (1 + 1e-5) + 1e-30).all()
    np.testing.assert_array_equal(y[3, 1], 0.0)
    # the max magnitude of each vector is represented exactly (up to float32 rounding)
    idx = np.abs(x).argmax(-1)[..., None]
    np.testing.assert_allclose(np.take_along_axis(y, idx, -1),
                               np.take_along_axis(x, idx, -1), rtol=1e-6)


def test_fp8_rounding_equals_astype_ties_included():
    """quant._to_e4m3 (integer arithmetic, fast on XLA:CPU) rounds exactly like
    astype(float8_e4m3fn): random magnitudes over 8 decades, every representable value,
    and every midpoint between neighbours (round half to even)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(1 << 16) * 10.0 ** rng.uniform(-5, 2.6, 1 << 16)
    allv = np.asarray(jnp.asarray(np.arange(256, dtype=np.uint8)).view(jnp.float8_e4m3fn)
                      .astype(jnp.float32))
    fin = np.unique(allv[np.isfinite(allv) & (allv >= 0)])
    mids = (fin[1:] + fin[:-1]) / 2
    x = np.clip(np.concatenate([x, mids, -mids, fin, -fin]), -448, 448).astype(np.float32)
    want = jnp.asarray(x).astype(jnp.float8_e4m3fn)
    got = jax.jit(quant._to_e4m3)(jnp.asarray(x))
    assert got.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("kind", KINDS)
def test_write_matches_quantizing_the_new_tokens(kind):
    """write_kv on a QuantizedKV: the new tokens' slots hold their quantization, the
    other slots are untouched, padding slots (out of range) are dropped."""
    K, NB, bs, H = 2, 5, 4, 16
    cache = quant.zeros((K, NB, bs, H), kind)
    rng = np.random.default_rng(1)
    new = jnp.asarray(rng.standard_normal((4, K, H)).astype(np.float32))
    slots = jnp.asarray([3, 9, 19, NB * bs], jnp.int32)       # the last one is padding
    k2, v2 = reference.write_kv(cache, cache, new, 2 * new, slots)
    vals, scales = quant.quantize(new, kind)
    got_v = np.asarray(k2.values.astype(jnp.float32)).reshape(K, NB * bs, H)
    got_s = np.asarray(k2.scales).reshape(K, NB * bs)
    for i, s in enumerate([3, 9, 19]):
        np.testing.assert_array_equal(got_v[:, s], np.asarray(vals[i].astype(jnp.float32)))
        np.testing.assert_array_equal(got_s[:, s], np.asarray(scales[i]))
    untouched = np.setdiff1d(np.arange(NB * bs), [3, 9, 19])
    assert not got_v[:, untouched].any() and not got_s[:, untouched].any()
    np.testing.assert_allclose(np.asarray(v2.scales).reshape(K, -1)[:, 9],
                               2 * got_s[:, 9], rtol=1e-6)


def _quantized_case(kind, *, kv_heads=2, group=3, head_dim=64, block_size=16, seed=0,
                    q_lens=(1, 7, 0, 9, 1), ctx=(13, 5, 4, 0, 40), num_tokens=24,
                    num_rows=6, dtype=jnp.float32):
    pages = -(-max(c + q for c, q in zip(ctx, q_lens)) // block_size)
    case = make_case(np.random.default_rng(seed), list(q_lens), list(ctx),
                     num_tokens=num_tokens, num_rows=num_rows, num_kv_heads=kv_heads,
                     group=group, head_dim=head_dim, block_size=block_size, pages=pages,
                     num_blocks=num_rows * pages + 3, dtype=dtype)
    kq = quant.QuantizedKV(*quant.quantize(case.k_cache, kind))
    vq = quant.QuantizedKV(*quant.quantize(case.v_cache, kind))
    deq = (quant.dequantize(kq.values, kq.scales, dtype),
           quant.dequantize(vq.values, vq.scales, dtype))
    return case, (kq, vq), deq


def _refs(case, deq, scale, window=None, cap=None):
    """ref.py (float64) over the dequantized cache and over the float cache."""
    args = list(case.kernel_args())
    want_q = ragged_paged_attention_ref(*args[:1], *deq, *args[3:], scale=scale,
                                        sliding_window=window, soft_cap=cap)
    want_f = ragged_paged_attention_ref(*args, scale=scale, sliding_window=window,
                                        soft_cap=cap)
    return want_q, want_f


def _check(out, case, want_q, want_f, kind, tight=TIGHT, padding_zero=True):
    n = case.num_real_tokens
    out = np.asarray(out, np.float32)
    if padding_zero:        # the kernels' contract (the jnp reference leaves padding as is)
        np.testing.assert_array_equal(out[n:], 0.0)
    np.testing.assert_allclose(out[:n], want_q[:n], atol=tight, rtol=tight)
    np.testing.assert_allclose(out[:n], want_f[:n], atol=LOOSE[kind], rtol=0)


def _backend_fn(name, scale, window, cap):
    if name == "reference":
        # jitted, as the engine runs it: one compiled program, not one per operation
        fn = jax.jit(functools.partial(reference.paged_attention, scale=scale,
                                       sliding_window=window, soft_cap=cap))
        return lambda case, kv: fn(case.q, case.k_new, case.v_new, *kv,
                                   AttentionMetadata(**case.metadata_fields()))
    if name == "cpu":
        from kernels_cpu.ragged_paged_attention import build
        from kernels_cpu.ragged_paged_attention.kernel import ragged_paged_attention
        if not build.available():
            pytest.skip("no C++ compiler")
        fn = ragged_paged_attention
    elif name == "pallas":
        from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention
        fn = functools.partial(ragged_paged_attention, interpret=True, backend="gpu")
    elif name == "pallas_tpu":      # kernel_tpu.py, the tiled TPU variant (interpret)
        from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention
        fn = functools.partial(ragged_paged_attention, interpret=True, backend="tpu",
                               pages_per_step=2)
    elif name == "splitk":
        from kernels_pallas.ragged_paged_attention.kernel_splitk import (
                                                                         ragged_paged_attention_splitk)
        fn = functools.partial(ragged_paged_attention_splitk, interpret=True, num_splits=3)
    else:
        raise AssertionError(name)
    return lambda case, kv: fn(case.q, *kv, *case.kernel_args()[3:], scale=scale,
                               sliding_window=window, soft_cap=cap)


BACKENDS = ("reference", "cpu", "pallas", "splitk", "pallas_tpu")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_over_quantized_cache(backend, kind):
    case, kv, deq = _quantized_case(kind)
    scale = 64 ** -0.5
    want_q, want_f = _refs(case, deq, scale)
    _check(_backend_fn(backend, scale, None, None)(case, kv), case, want_q, want_f, kind,
           padding_zero=backend != "reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_quantized_window_softcap_mqa_h128(backend):
    """Other shapes: MQA(8) with head_dim 128 (the CPU kernel's unrolled int8 path),
    a sliding window and a soft cap."""
    case, kv, deq = _quantized_case("int8", kv_heads=1, group=8, head_dim=128, seed=5,
                                    q_lens=(1, 12, 1), ctx=(30, 3, 47), num_rows=3)
    scale, window, cap = 128 ** -0.5, 11, 4.0
    want_q, want_f = _refs(case, deq, scale, window, cap)
    _check(_backend_fn(backend, scale, window, cap)(case, kv), case, want_q, want_f, "int8",
           padding_zero=backend != "reference")


@pytest.mark.parametrize("backend", ("cpu", "pallas"))
def test_backend_quantized_generic_shapes(backend):
    """Block size 8 and head_dim 32: the CPU kernel's generic (not unrolled) path."""
    case, kv, deq = _quantized_case("fp8", kv_heads=2, group=2, head_dim=32, block_size=8,
                                    seed=7, q_lens=(3, 1), ctx=(9, 20), num_rows=2,
                                    num_tokens=8)
    scale = 32 ** -0.5
    want_q, want_f = _refs(case, deq, scale)
    _check(_backend_fn(backend, scale, None, None)(case, kv), case, want_q, want_f, "fp8")


# ---- TPU v3 kernel (TPU interpreter: DMAs and semaphores modelled) ----------------------
def _v3(**kw):
    from kernels_pallas.ragged_paged_attention import kernel_tpu_v3 as v3
    return jax.jit(functools.partial(v3.ragged_paged_attention_v3, interpret=True, **kw))


@pytest.mark.parametrize("kind", KINDS)
def test_tpu_v3_over_quantized_cache(kind):
    """Several chunks per tile (pages_per_chunk 1), a window (unfetched pages whose
    stale scales must not leak), GQA 3."""
    case, kv, deq = _quantized_case(kind, head_dim=128, block_size=8, seed=3)
    scale, window = 128 ** -0.5, 13
    want_q, want_f = _refs(case, deq, scale, window)
    out = _v3(scale=scale, sliding_window=window, block_m=8, pages_per_chunk=1)(
        case.q, *kv, *case.kernel_args()[3:])
    _check(out, case, want_q, want_f, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_tpu_v3_fused_write_matches_scatter(kind):
    """The fused update quantizes k_new/v_new and writes values and scales, bit-equal to
    write_kv's scatter into a quantized cache whose new slots held junk."""
    case, (kq, vq), _ = _quantized_case(kind, head_dim=128, block_size=8, seed=4)
    K, NB, bs, H = kq.shape
    slots = jnp.asarray(case.slot_mapping)

    def junk(c):
        vals = c.values.reshape(K, NB * bs, H).at[:, slots].set(
            jnp.asarray(3, c.values.dtype), mode="drop").reshape(K, NB, bs, H)
        sc = c.scales.reshape(K, NB * bs).at[:, slots].set(1e4, mode="drop")
        return quant.QuantizedKV(vals, sc.reshape(K, NB, bs))

    jk, jv = junk(kq), junk(vq)
    want_k, want_v = reference.write_kv(jk, jv, case.k_new, case.v_new, slots)
    q, _, _, cu, seq, bt = case.kernel_args()
    out, k2, v2 = _v3(scale=0.125, block_m=16, pages_per_chunk=2,
                      quantize_new=quant.quantize_for_cache)(
        q, jk, jv, cu, seq, bt, k_new=case.k_new, v_new=case.v_new)
    for got, want in ((k2, want_k), (v2, want_v)):
        assert isinstance(got, quant.QuantizedKV)
        np.testing.assert_array_equal(np.asarray(got.values.astype(jnp.float32)),
                                      np.asarray(want.values.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    deq = [quant.dequantize(c.values, c.scales) for c in (want_k, want_v)]
    want = ragged_paged_attention_ref(q, *deq, cu, seq, bt, scale=0.125)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(out[:n]), want[:n], atol=TIGHT, rtol=TIGHT)


# ---- lowering for the accelerators from this CPU (jax.export) ---------------------------
def _abstract_quantized(K, NB, bs, H, kind="int8"):
    sds = jax.ShapeDtypeStruct
    one = quant.QuantizedKV(sds((K, NB, bs, H), quant.STORAGE[kind]),
                            sds((K, NB, bs), jnp.float32))
    return one, one


@pytest.mark.parametrize("update", [False, True])
def test_tpu_v3_quantized_lowers_for_tpu(update, monkeypatch):
    """Pallas -> Mosaic at Llama-3-8B head shapes with an int8 cache (not the Mosaic
    compiler: no TPU here)."""
    from jax import export
    from kernels_pallas.ragged_paged_attention import kernel_tpu_v3 as v3
    pretend_tpu_v5e(monkeypatch)
    sds = jax.ShapeDtypeStruct
    T, R, K, N, H, bs, P, NB = 64, 64, 8, 32, 128, 16, 128, 2048
    kw = {}
    if update:
        kw = {"k_new": sds((T, K, H), jnp.bfloat16), "v_new": sds((T, K, H), jnp.bfloat16)}
    fn = jax.jit(functools.partial(v3.ragged_paged_attention_v3, scale=H ** -0.5,
                                   chip="v5e", sliding_window=128 if update else None,
                                   quantize_new=quant.quantize_for_cache))
    exported = export.export(fn, platforms=["tpu"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("tpu_custom_call")])(
        sds((T, N, H), jnp.bfloat16), *_abstract_quantized(K, NB, bs, H),
        sds((R + 1,), jnp.int32), sds((R,), jnp.int32), sds((R, P), jnp.int32), **kw)
    assert exported.mlir_module().count("tpu_custom_call") == 1
    assert len(exported.out_avals) == (5 if update else 1)     # out + 2 x (values, scales)


def test_tpu_tiled_quantized_lowers_for_tpu(monkeypatch):
    """kernel_tpu.py (the non-default TPU variant) with an int8 cache -> Mosaic."""
    from jax import export
    from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention
    pretend_tpu_v5e(monkeypatch)
    sds = jax.ShapeDtypeStruct
    T, R, K, N, H, bs, P, NB = 64, 64, 8, 32, 128, 16, 128, 2048
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=H ** -0.5, backend="tpu"))
    exported = export.export(fn, platforms=["tpu"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("tpu_custom_call")])(
        sds((T, N, H), jnp.bfloat16), *_abstract_quantized(K, NB, bs, H),
        sds((R + 1,), jnp.int32), sds((R,), jnp.int32), sds((R, P), jnp.int32))
    assert exported.mlir_module().count("tpu_custom_call") == 1


@pytest.mark.parametrize("variant", ["tiled", "splitk"])
def test_gpu_kernels_quantized_lower_for_cuda(variant):
    """Pallas -> Triton with an int8 cache, Llama-3-8B decode shapes."""
    from jax import export
    from kernels_pallas.ragged_paged_attention import kernel_splitk
    from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention
    sds = jax.ShapeDtypeStruct
    T, R, K, N, H, bs, P, NB = 64, 64, 8, 32, 128, 16, 128, 2048
    fn = (functools.partial(ragged_paged_attention, backend="gpu") if variant == "tiled"
          else functools.partial(kernel_splitk.ragged_paged_attention_splitk, num_splits=4))
    exported = export.export(jax.jit(functools.partial(fn, scale=H ** -0.5)),
                             platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        sds((T, N, H), jnp.bfloat16), *_abstract_quantized(K, NB, bs, H),
        sds((R + 1,), jnp.int32), sds((R,), jnp.int32), sds((R, P), jnp.int32))
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text
    assert "tensor<8x2048x16x128xi8>" in text and "tensor<8x2048x16xf32>" in text


def test_bad_kv_cache_dtype_is_a_plain_error():
    from jaxserve.config import ConfigError, EngineArgs
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype int8 cannot be combined"):
        EngineArgs(kv_cache_dtype="int8", kv_transfer_config='{"kv_role": "kv_producer"}')
    import argparse
    from jaxserve.cli_args import add_cli_args
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"


# the TP=8 run first: export_runs.py sets the simulated device count from the first run
EXPORTS = {"tpu": 8, "cuda": 1}


@pytest.fixture(scope="module")
def int8_kv_exports() -> dict[str, tuple[int, list[str]]]:
    """{platform: (exit status, output lines)} of both exports, run in one process of
    their own (simulated devices; export_runs.py): start-up and jax's import are most
    of a run's cost."""
    from export_runs import run_exports
    return run_exports({platform: ["--platform", platform, "--shape", "llama3-8b",
                                   "--tp", str(tp), "--max-buckets", "1",
                                   "--kv-cache-dtype", "int8"]
                        for platform, tp in EXPORTS.items()}, timeout=600)


@pytest.mark.parametrize("platform", list(EXPORTS))
@pytest.mark.slow
def test_fused_step_with_int8_kv_exports(int8_kv_exports, platform):
    """The engine's whole fused step with an int8 KV cache lowers for TPU (v3 kernel,
    fused quantized write, TP=8 under shard_map) and CUDA (Triton) from this CPU:
    jaxserve.tools.export_check --kv-cache-dtype int8, largest bucket."""
    import re
    rc, out = int8_kv_exports[platform]
    print("\n".join(out))
    assert rc == 0
    lines = [l for l in out if not l.startswith("#")]
    assert len(lines) == 1 and re.match(rf"OK {platform} .* kernel_calls=32", lines[0]), lines
