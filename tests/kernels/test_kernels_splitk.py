"""Split-K (flash-decoding) GPU ragged paged attention in interpret mode vs the
float64 ref.py, over the same ragged layouts as test_kernels_ragged_paged_attention.py
(prefill tiles too: the split is over KV only, so every tile must stay exact),
the per-bucket split rule, and Triton lowering through jax.export for CUDA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import export_target
from kernels_pallas.ragged_paged_attention import kernel_splitk as sk
from kernels_pallas.ragged_paged_attention.cases import make_case
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref
from test_kernels_ragged_paged_attention import FAST_COMPILE, TOL, cases

CONFIGS = [
    # kv_heads, group, head_dim, block_size, dtype, window, cap, kwargs
    pytest.param(2, 4, 64, 8, jnp.float32, None, None,
                 {"num_splits": 3, "block_kv": 16}, id="gqa4-s3-kv16"),
    pytest.param(4, 1, 64, 16, jnp.float32, None, None,
                 {"num_splits": 8, "block_kv": 16}, id="mha-s8-mostly-empty-splits"),
    pytest.param(2, 2, 64, 8, jnp.float32, 5, None,
                 {"num_splits": 2, "block_kv": 16}, id="window5-s2"),
    pytest.param(2, 4, 128, 16, jnp.bfloat16, 9, 10.0,
                 {"num_splits": 4, "block_kv": 16, "block_m": 32}, id="bf16-window-cap-m32"),
    pytest.param(1, 8, 128, 8, jnp.float32, None, None, {"num_splits": 1}, id="mqa8-s1"),
]


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,dtype,window,cap,kwargs", CONFIGS)
def test_splitk_matches_ref(kv_heads, group, head_dim, block_size, dtype, window, cap,
                            kwargs):
    scale = head_dim ** -0.5
    atol, rtol = TOL[dtype]
    fn = jax.jit(functools.partial(sk.ragged_paged_attention_splitk, scale=scale,
                                   sliding_window=window, soft_cap=cap, interpret=True,
                                   **kwargs), compiler_options=FAST_COMPILE)
    for i, case in enumerate(cases(hash((kv_heads, group, block_size, 7)) % 2**31,
                                   kv_heads=kv_heads, group=group, head_dim=head_dim,
                                   block_size=block_size, dtype=dtype)):
        n = case.num_real_tokens
        out = fn(*case.kernel_args())
        want = ragged_paged_attention_ref(*case.kernel_args(), scale=scale,
                                          sliding_window=window, soft_cap=cap)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype, i
        np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)
        np.testing.assert_allclose(np.asarray(out[:n], np.float32), want[:n], atol=atol,
                                   rtol=rtol, err_msg=f"layout {i}")


def test_splitk_long_decode_and_head_offset():
    """A decode bucket with long, uneven contexts (splits of many blocks, some rows
    shorter than one split) and a kv_head_offset shard of a replicated cache."""
    rng = np.random.default_rng(2)
    case = make_case(rng, [1, 1, 1, 0], [250, 3, 130, 0], num_tokens=4, num_rows=4,
                     num_kv_heads=2, group=4, head_dim=64, block_size=16, pages=16,
                     num_blocks=40)
    scale = 0.125
    want = ragged_paged_attention_ref(*case.kernel_args(), scale=scale)
    fn = jax.jit(functools.partial(sk.ragged_paged_attention_splitk, scale=scale,
                                   interpret=True, num_splits=5, block_kv=16),
                 compiler_options=FAST_COMPILE)
    out = fn(*case.kernel_args())
    np.testing.assert_allclose(np.asarray(out[:3]), want[:3], atol=2e-5, rtol=2e-5)
    q, *rest = case.kernel_args()
    shard = fn(q[:, 4:6], *rest, kv_head_offset=jnp.int32(1))
    np.testing.assert_allclose(np.asarray(shard[:3]), want[:3, 4:6], atol=2e-5, rtol=2e-5)


def test_combine_ignores_empty_and_fully_masked_splits():
    acc = jnp.array([[[[[2.0]], [[9.0]], [[0.0]]]]])       # [K=1, W=1, S=3, M=1, H=1]
    m = jnp.array([[[[1.0], [-1e30], [-1e30]]]])          # split 1 saw only masked keys
    l = jnp.array([[[[4.0], [3.0], [0.0]]]])              # split 2 is empty
    np.testing.assert_allclose(np.asarray(sk.combine_splits(acc, m, l, jnp.float32)),
                               [[[[0.5]]]])
    # two real splits: exp-weighted merge of their sums
    acc2 = jnp.array([[[[[1.0]], [[3.0]]]]])
    m2, l2 = jnp.array([[[[0.0], [1.0]]]]), jnp.array([[[[1.0], [2.0]]]])
    want = (np.exp(-1.0) * 1.0 + 3.0) / (np.exp(-1.0) * 1.0 + 2.0)
    np.testing.assert_allclose(np.asarray(sk.combine_splits(acc2, m2, l2, jnp.float32)),
                               [[[[want]]]], rtol=1e-6)


def test_split_rule():
    # decode buckets whose rows x kv heads underfill 132 SMs split (~2 waves, capped)
    assert sk.choose_num_splits(8, 8, 8, 132) == 5          # 64 programs -> 320
    assert sk.choose_num_splits(1, 1, 8, 132) == sk.MAX_SPLITS
    assert sk.choose_num_splits(64, 64, 8, 132) == 1         # 512 programs: enough
    assert sk.choose_num_splits(512, 16, 8, 132) == 1        # prefill/mixed: no split
    assert sk.choose_num_splits(8, 8, 1, 132) == sk.MAX_SPLITS  # TP shard: 1 kv head


@pytest.mark.parametrize("tokens,rows", [(8, 8), (1, 1)])
def test_splitk_lowers_for_cuda(tokens, rows):
    """Pallas -> Triton IR at Llama-3-8B head shapes (not the Triton compiler)."""
    from jax import export
    sds = jax.ShapeDtypeStruct
    K, N, H, bs, P, NB = 8, 32, 128, 16, 512, 4096
    args = (sds((tokens, N, H), jnp.bfloat16), sds((K, NB, bs, H), jnp.bfloat16),
            sds((K, NB, bs, H), jnp.bfloat16), sds((rows + 1,), jnp.int32),
            sds((rows,), jnp.int32), sds((rows, P), jnp.int32))
    fn = jax.jit(functools.partial(sk.ragged_paged_attention_splitk, scale=H ** -0.5,
                                   num_splits=sk.choose_num_splits(tokens, rows, K),
                                   sliding_window=128, soft_cap=30.0))
    with export_target.cuda():      # jax 0.11's Triton lowering asks for a GPU: name one
        text = export.export(fn, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xla.gpu.triton" in text.mlir_module()


def test_backend_picks_kernel_per_bucket():
    from jaxserve.attention import pallas_backend as pb
    from kernels_pallas.ragged_paged_attention import kernel_tpu_v3
    gather = functools.partial(pb.kernel_for_bucket, gpu_kernel="gather")
    small = gather("cuda", 8, 8, 8)
    assert small.func is sk.ragged_paged_attention_splitk and small.keywords["num_splits"] == 5
    assert gather("cuda", 256, 256, 8).keywords == {"backend": "gpu"}
    assert gather("cuda", 512, 16, 8).keywords == {"backend": "gpu"}
    assert pb.kernel_for_bucket("cpu", 8, 8, 8).keywords == {"backend": "gpu"}
    assert pb.kernel_for_bucket("tpu", 8, 8, 8) is kernel_tpu_v3.ragged_paged_attention_v3
    assert pb.kernel_for_bucket("tpu", 8, 8, 8, tpu_kernel="tiled").keywords == {
        "backend": "tpu"}
    assert pb.single_table_width("cuda") and not pb.single_table_width("tpu")
    assert not pb.single_table_width("cpu")
