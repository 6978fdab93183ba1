"""The page-by-page GPU kernel (kernel_paged.py) in Pallas interpret mode against the
float64 ref.py, over the ragged layouts of test_kernels_ragged_paged_attention.py:
page sizes 16/64/128 (whole pages per step and runs of a page), GQA/MHA/MQA, bf16,
int8 KV, sliding window, soft cap, split-K, tensor-parallel slices read by
kv_head_offset (one and two KV heads per device), step tiles shared across calls; the
wave-aware split rule over a grid of shapes; the backend's choice and per-step tiles;
and Triton lowering for CUDA at Llama-3-8B head shapes (TP=1 and a TP=8 slice).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import kv_quant
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas import export_target
from kernels_pallas.ragged_paged_attention import kernel_paged as kp
from kernels_pallas.ragged_paged_attention.cases import make_case
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref
from test_kernels_ragged_paged_attention import FAST_COMPILE, TOL, cases


def run(case, args=None, **kw):
    fn = jax.jit(functools.partial(kp.ragged_paged_attention_paged, interpret=True, **kw),
                 compiler_options=FAST_COMPILE)
    return fn(*(args or case.kernel_args()))


def check(case, out, *, scale, window=None, cap=None, dtype=jnp.float32, heads=slice(None),
          caches=None):
    atol, rtol = TOL[dtype]
    n = case.num_real_tokens
    k, v = caches or (case.k_cache, case.v_cache)
    want = ragged_paged_attention_ref(case.q, k, v, case.cu_q_lens, case.seq_lens,
                                      case.block_tables, scale=scale, sliding_window=window,
                                      soft_cap=cap)[:, heads]
    assert out.shape == want.shape and out.dtype == case.q.dtype
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)
    np.testing.assert_allclose(np.asarray(out[:n], np.float32), want[:n], atol=atol, rtol=rtol)


CONFIGS = [
    # kv_heads, group, head_dim, block_size, dtype, window, cap, kwargs
    pytest.param(2, 4, 64, 16, jnp.float32, None, None, {"block_kv": 32},
                 id="gqa4-bs16-two-pages-per-step"),
    pytest.param(4, 1, 64, 64, jnp.float32, 5, None, {"block_kv": 16},
                 id="mha-bs64-runs-of-a-page-window"),
    pytest.param(1, 8, 128, 128, jnp.bfloat16, 9, 10.0, {"block_kv": 32},
                 id="mqa8-bs128-bf16-window-cap"),
    pytest.param(2, 3, 64, 16, jnp.float32, None, 20.0, {"block_kv": 16, "num_splits": 3},
                 id="gqa3-split3-cap"),
]


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,dtype,window,cap,kwargs", CONFIGS)
def test_paged_matches_ref(kv_heads, group, head_dim, block_size, dtype, window, cap, kwargs):
    scale = head_dim ** -0.5
    for case in list(cases(7 + block_size, kv_heads=kv_heads, group=group,
                           head_dim=head_dim, block_size=block_size, dtype=dtype))[:4]:
        out = run(case, scale=scale, sliding_window=window, soft_cap=cap, **kwargs)
        check(case, out, scale=scale, window=window, cap=cap, dtype=dtype)


def test_int8_cache_with_splits():
    """An int8 QuantizedKV cache (values and per-slot scales, dequantized as pages are
    read) equals ref.py on the dequantized cache, split over 2."""
    case = list(cases(3, kv_heads=2, group=2, head_dim=64, block_size=16,
                      dtype=jnp.float32))[1]
    (kq, ks), (vq, vs) = (kv_quant.quantize(c, "int8") for c in (case.k_cache, case.v_cache))
    kc, vc = kv_quant.QuantizedKV(kq, ks), kv_quant.QuantizedKV(vq, vs)
    q, _, _, *rest = case.kernel_args()
    out = run(case, (q, kc, vc, *rest), scale=0.125, block_kv=32, num_splits=2)
    check(case, out, scale=0.125, caches=(kv_quant.dequantize(kq, ks),
                                          kv_quant.dequantize(vq, vs)))


@pytest.mark.parametrize("offset,kv_heads", [(1, 1), (2, 2)])
def test_tp_slice_by_kv_head_offset(offset, kv_heads):
    """A tensor-parallel shard reads KV heads [offset, offset + kv_heads) of a wider cache
    (one or two KV heads per device) and equals those query heads of the whole batch;
    long uneven decode contexts, split over 4."""
    rng = np.random.default_rng(11)
    case = make_case(rng, [1, 1, 1, 0], [250, 3, 130, 0], num_tokens=4, num_rows=4,
                     num_kv_heads=4, group=2, head_dim=64, block_size=16, pages=16,
                     num_blocks=40)
    q, *rest = case.kernel_args()
    heads = slice(2 * offset, 2 * (offset + kv_heads))
    out = run(case, (q[:, heads], *rest), scale=0.125, block_kv=32, num_splits=4,
              kv_heads=kv_heads, kv_head_offset=jnp.int32(offset))
    check(case, out, scale=0.125, heads=heads)


def test_step_tiles_shared_across_calls():
    """Tiles built once (as the engine does per step) give the same bits as tiles built
    inside the call, for two 'layers' with different q; every token lands once."""
    case = list(cases(5, kv_heads=2, group=4, head_dim=64, block_size=16,
                      dtype=jnp.float32))[0]
    T, R = case.q.shape[0], case.seq_lens.shape[0]
    tiles = kp.make_step_tiles(jnp.asarray(case.cu_q_lens), jnp.asarray(case.seq_lens), T,
                               kp.block_tokens(T, R, 4))
    tt, slot = np.asarray(tiles.token_tile), np.asarray(tiles.token_slot)
    n = case.num_real_tokens
    assert (tt[n:] == -1).all() and len(set(zip(tt[:n], slot[:n]))) == n
    for q in (case.q, -case.q * 0.5):
        args = (q, *case.kernel_args()[1:])
        own = run(case, args, scale=0.125, block_kv=32)
        shared = run(case, args, scale=0.125, block_kv=32, tiles=tiles)
        np.testing.assert_array_equal(np.asarray(own), np.asarray(shared))


def test_tile_shapes():
    assert kp.block_tokens(8, 8, 4) == 1 and kp.block_tokens(512, 16, 4) == 16
    assert kp.tile_rows(4, 1) == 16 and kp.tile_rows(4, 16) == 64
    assert kp.tile_rows(3, 21) == 64 and kp.tile_rows(32, 1) == 32
    assert kp.tuning(128, jnp.bfloat16) == kp.TUNING[(128, "bfloat16")]
    assert kp.tuning(96, jnp.bfloat16) == kp.DEFAULT_TUNING


# rows x kv heads per device (8: TP=1, 2: TP=4, 1: TP=8 of Llama-3-8B) x context blocks
# -> splits on 132 SMs. Few programs split until ~2 per SM; long contexts do not change
# that (every split stays long), short ones cap the count at one block per split.
SPLIT_TABLE = {
    #        K=8: C=8 32 128 512  K=2: C=8 32 128 512  K=1: C=8 32 128 512
    1:   [8, 32, 32, 32, 8, 32, 32, 32, 8, 32, 32, 32],
    8:   [4, 4, 4, 4, 8, 16, 16, 16, 8, 32, 32, 32],
    16:  [2, 2, 2, 2, 8, 8, 8, 8, 8, 16, 16, 16],
    32:  [1, 1, 1, 1, 4, 4, 4, 4, 8, 8, 8, 8],
    64:  [1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4],
    128: [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2],
    256: [1] * 12,
}


def test_split_rule_over_a_grid():
    got = {r: [kp.choose_num_splits(r, r, k, c, 132) for k in (8, 2, 1)
               for c in (8, 32, 128, 512)] for r in SPLIT_TABLE}
    assert got == SPLIT_TABLE
    for r in SPLIT_TABLE:
        for k in (8, 2, 1):
            s = kp.choose_num_splits(r, r, k, 128, 132)
            # the chosen split never needs more waves of 2 programs per SM than it saves
            assert kp.split_cost(r * k, 128, s, 132) <= kp.split_cost(r * k, 128, 1, 132)
    assert kp.choose_num_splits(512, 16, 8, 128) == 1       # prefill/mixed: enough tiles
    assert kp.choose_num_splits(8, 8, 8, 1) == 1            # one block: nothing to split
    assert kp.choose_num_splits(8, 8, 8, 128, sms=16) == 1  # a small GPU is full already


def test_backend_chooses_paged_kernel_and_builds_tiles_once():
    from jaxserve.attention import pallas_backend as pb
    from jaxserve.model import decoder
    small = pb.kernel_for_bucket("cuda", 8, 8, 8, context_blocks=128)
    assert small.func is kp.ragged_paged_attention_paged
    assert small.keywords["num_splits"] == 4
    assert pb.kernel_for_bucket("cuda", 512, 16, 8).keywords == {"num_splits": 1}
    old = pb.kernel_for_bucket("cuda", 512, 16, 8, gpu_kernel="gather")
    assert old.keywords == {"backend": "gpu"}
    assert pb.kernel_for_bucket("cuda", 8, 8, 8, page_size=8).keywords["num_splits"] == 5
    fn = pb.make_attn_fn(platform="cuda")
    assert isinstance(fn, pb.SharedTilesAttention)
    assert not isinstance(pb.make_attn_fn(platform="cpu"), pb.SharedTilesAttention)
    case = list(cases(1, kv_heads=2, group=4, head_dim=64, block_size=16,
                      dtype=jnp.float32))[0]
    md = AttentionMetadata(**case.metadata_fields())

    class Cfg:
        num_heads, num_kv_heads = 8, 2
    prepared = decoder.prepare_attention(fn, md, Cfg)       # type: ignore[arg-type]
    want = kp.make_step_tiles(md.query_start_loc, md.seq_lens, md.num_tokens, 16)
    assert prepared.kernel_tiles.block_t == 16
    np.testing.assert_array_equal(prepared.kernel_tiles.token_tile, want.token_tile)
    assert decoder.prepare_attention(pb.make_attn_fn(platform="cpu"), md, Cfg) is md


@pytest.mark.parametrize("tokens,rows,kv_heads,heads,splits,int8,bs,offset", [
    (8, 8, 8, 32, 4, False, 16, False),     # TP=1 decode, split, two pages per step
    (64, 8, 8, 32, 1, True, 128, False),    # TP=1 mixed bucket, int8, runs of a page
    (16, 16, 1, 4, 16, False, 64, False),   # TP=8 slice: 1 kv head, 4 q heads, split
    (8, 8, 2, 8, 4, False, 16, True),       # 2 of 8 kv heads by kv_head_offset (TP=4)
])
def test_paged_lowers_for_cuda(tokens, rows, kv_heads, heads, splits, int8, bs, offset):
    """Pallas -> Triton IR at Llama-3-8B head shapes (head_dim 128, bf16), from this
    host: export_target.cuda() names the GPU (jax 0.11 asks for one). Checks the
    lowering rules, not the Triton compiler."""
    from jax import export
    sds = jax.ShapeDtypeStruct
    H, P, NB = 128, 8192 // bs, 4096
    cache_heads = 8 if offset else kv_heads
    cache = sds((cache_heads, NB, bs, H), jnp.bfloat16)
    if int8:
        cache = kv_quant.QuantizedKV(sds((cache_heads, NB, bs, H), jnp.int8),
                                     sds((cache_heads, NB, bs), jnp.float32))
    args = [sds((tokens, heads, H), jnp.bfloat16), cache, cache, sds((rows + 1,), jnp.int32),
            sds((rows,), jnp.int32), sds((rows, P), jnp.int32)]
    kw = dict(scale=H ** -0.5, num_splits=splits, sliding_window=4096, soft_cap=30.0)
    if offset:
        kw["kv_heads"] = kv_heads
        fn = jax.jit(lambda *a: kp.ragged_paged_attention_paged(*a[:6], kv_head_offset=a[6],
                                                                **kw))
        args.append(sds((), jnp.int32))
    else:
        fn = jax.jit(functools.partial(kp.ragged_paged_attention_paged, **kw))
    with export_target.cuda():
        text = export.export(fn, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xla.gpu.triton" in text.mlir_module()


# ---- the Mosaic GPU decode kernel (kernel_mosaic_gpu.py) ---------------------------------

@pytest.mark.parametrize("kv_heads,group,head_dim,window,cap", [
    (2, 4, 64, None, None), (1, 8, 128, 100, 20.0)])
def test_mosaic_gpu_kernel_matches_ref(kv_heads, group, head_dim, window, cap):
    """The Mosaic GPU interpreter (simulated TMA copies and barriers; the two products as
    plain dots, the interpreter has no WGMMA): decodes on and across page boundaries, an
    empty row, a row of 3 tokens (each token its own tile), pages of 64, bf16."""
    from kernels_pallas.ragged_paged_attention import kernel_mosaic_gpu as mg
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, [1, 1, 0, 3, 1], [63, 140, 0, 61, 0], num_tokens=8, num_rows=6,
                     num_kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=64,
                     pages=4, num_blocks=16, dtype=jnp.bfloat16)
    out = mg.ragged_paged_attention_mgpu(*case.kernel_args(), scale=head_dim ** -0.5,
                                         sliding_window=window, soft_cap=cap, interpret=True)
    check(case, out, scale=head_dim ** -0.5, window=window, cap=cap, dtype=jnp.bfloat16)


@pytest.mark.parametrize("rows,kv_heads,heads", [(8, 8, 32), (16, 1, 4)])
def test_mosaic_gpu_kernel_lowers_for_cuda(rows, kv_heads, heads):
    """plgpu.kernel -> the mosaic_gpu custom call at Llama-3-8B head shapes (TP=1, and a
    TP=8 slice), pages of 64, window and soft cap: the Mosaic GPU lowering (layouts,
    WGMMA operands, TMA transforms), not its compiler."""
    from jax import export
    from kernels_pallas.ragged_paged_attention import kernel_mosaic_gpu as mg
    sds = jax.ShapeDtypeStruct
    H, bs, P, NB = 128, 64, 128, 1024
    cache = sds((kv_heads, NB, bs, H), jnp.bfloat16)
    args = (sds((rows, heads, H), jnp.bfloat16), cache, cache, sds((rows + 1,), jnp.int32),
            sds((rows,), jnp.int32), sds((rows, P), jnp.int32))
    fn = jax.jit(functools.partial(mg.ragged_paged_attention_mgpu, scale=H ** -0.5,
                                   sliding_window=4096, soft_cap=30.0))
    with export_target.cuda():
        text = export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in text


def test_backend_mosaic_choice():
    from jaxserve.attention import pallas_backend as pb
    from kernels_pallas.ragged_paged_attention import kernel_mosaic_gpu as mg
    pick = functools.partial(pb.kernel_for_bucket, "cuda", gpu_kernel="mosaic")
    assert pick(8, 8, 8, page_size=64) is mg.ragged_paged_attention_mgpu
    assert pick(8, 8, 8, page_size=16).func is kp.ragged_paged_attention_paged
    assert pick(8, 8, 8, page_size=64, quantized=True).func is kp.ragged_paged_attention_paged
    assert pick(512, 16, 8, page_size=64).func is kp.ragged_paged_attention_paged
