"""Ragged paged attention: Pallas kernel (interpret mode) vs ref.py vs the jnp
reference backend, over many small shapes.

Every config compiles once (~2 s in interpret mode) and then runs several
ragged layouts of the same padded shape: decodes, prefill chunks with and
without context whose boundaries split blocks, empty rows, padded tail tokens.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import reference
from kernels_pallas import export_target
from kernels_pallas.ragged_paged_attention import common
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.cases import make_case
from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref
from tpu_export import pretend_tpu_v5e

# Interpret-mode programs are big; cheaper XLA CPU codegen cuts their compile time
# by about a third without changing the numbers checked here.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
reference_jit = jax.jit(reference.paged_attention, compiler_options=FAST_COMPILE,
                        static_argnames=("scale", "sliding_window", "soft_cap"))
T_PAD, R_PAD, MAX_SEQ = 24, 6, 40
# (atol, rtol) against the float32 ref.py. bf16: q, k, v and the probabilities
# fed to the PV matmul are bf16 (8-bit mantissa), outputs are O(1).
TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (3e-2, 3e-2)}

LAYOUTS = [
    # (q_lens, ctx_lens): decode, chunk after context splitting a block, empty row
    # in the middle, first-chunk prefill, single-token first prefill; tail padded.
    ([1, 7, 0, 9, 1], [13, 5, 4, 0, 0]),
    # all decodes, contexts on and around block boundaries
    ([1, 1, 1, 1, 1, 1], [0, 7, 8, 15, 16, 33]),
    # one long prefill chunk filling the whole token budget
    ([24], [16]),
]


def random_layout(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    rows = int(rng.integers(1, R_PAD + 1))
    cuts = np.sort(rng.integers(0, T_PAD + 1, size=rows))
    q_lens = np.diff(np.concatenate([[0], cuts])).tolist()
    ctx = [int(rng.integers(0, MAX_SEQ - q + 1)) for q in q_lens]
    return q_lens, ctx


def cases(seed: int, *, kv_heads: int, group: int, head_dim: int, block_size: int, dtype):
    rng = np.random.default_rng(seed)
    layouts = LAYOUTS + [random_layout(rng) for _ in range(2)]
    pages = -(-MAX_SEQ // block_size)
    for q_lens, ctx in layouts:
        yield make_case(rng, q_lens, ctx, num_tokens=T_PAD, num_rows=R_PAD,
                        num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                        block_size=block_size, pages=pages, num_blocks=R_PAD * pages + 3,
                        dtype=dtype)


def check_all_agree(case, out, *, scale, sliding_window, soft_cap, dtype):
    atol, rtol = TOL[dtype]
    n = case.num_real_tokens
    want = ragged_paged_attention_ref(case.q, case.k_cache, case.v_cache, case.cu_q_lens,
                                      case.seq_lens, case.block_tables, scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap)
    ref_backend = reference_jit(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache,
                                AttentionMetadata(**case.metadata_fields()), scale=scale, sliding_window=sliding_window,
                                soft_cap=soft_cap)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)
    np.testing.assert_allclose(np.asarray(out[:n], np.float32), want[:n], atol=atol, rtol=rtol)
    np.testing.assert_allclose(np.asarray(ref_backend[:n], np.float32), want[:n], atol=atol,
                               rtol=rtol)


CONFIGS = [
    # kv_heads, group, head_dim, block_size, dtype, sliding_window, soft_cap, kwargs
    pytest.param(4, 1, 64, 8, jnp.float32, None, None, {}, id="mha-h64-bs8"),
    pytest.param(2, 4, 64, 16, jnp.float32, None, None, {}, id="gqa4-h64-bs16"),
    pytest.param(1, 8, 128, 8, jnp.float32, None, None, {"block_m": 32}, id="mqa8-h128-m32"),
    pytest.param(2, 3, 64, 8, jnp.float32, None, None, {"block_m": 16}, id="gqa3-m16"),
    pytest.param(2, 2, 64, 8, jnp.float32, 5, None, {"block_kv": 16}, id="window5-kv16"),
    pytest.param(2, 2, 128, 16, jnp.float32, 17, 5.0, {}, id="window17-softcap"),
    pytest.param(2, 4, 128, 16, jnp.bfloat16, None, None, {}, id="bf16-gqa4-h128"),
    pytest.param(4, 1, 64, 8, jnp.bfloat16, 9, 10.0, {"block_kv": 32}, id="bf16-window-cap"),
    pytest.param(2, 4, 64, 8, jnp.float32, None, None, {"backend": "tpu", "block_m": 8,
                                                        "pages_per_step": 2}, id="tpu-gqa4"),
    pytest.param(2, 2, 64, 16, jnp.bfloat16, 11, 4.0, {"backend": "tpu"}, id="tpu-bf16-w-cap"),
]


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,dtype,window,cap,kwargs", CONFIGS)
def test_kernel_matches_refs(kv_heads, group, head_dim, block_size, dtype, window, cap,
                             kwargs):
    scale = head_dim ** -0.5
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=scale, sliding_window=window,
                                   soft_cap=cap, interpret=True, **kwargs),
                 compiler_options=FAST_COMPILE)
    for i, case in enumerate(cases(hash((kv_heads, group, head_dim, block_size)) % 2**31,
                                   kv_heads=kv_heads, group=group, head_dim=head_dim,
                                   block_size=block_size, dtype=dtype)):
        out = fn(*case.kernel_args())
        try:
            check_all_agree(case, out, scale=scale, sliding_window=window, soft_cap=cap,
                            dtype=dtype)
        except AssertionError as e:
            raise AssertionError(f"layout {i}: q_lens={np.diff(case.cu_q_lens).tolist()} "
                                 f"seq_lens={case.seq_lens.tolist()}") from e


def test_schedule_covers_every_query_row_once():
    cu = jnp.array([0, 5, 5, 6, 17, 17], jnp.int32)
    seq = jnp.array([9, 0, 1, 20, 0], jnp.int32)
    group, block_m, T = 3, 8, 20
    s = jax.jit(common.make_schedule, static_argnums=(2, 3, 4))(cu, seq, T, group, block_m)
    n = np.asarray(s.n)
    src = np.asarray(s.src).reshape(-1, block_m)
    used = np.concatenate([src[w, :n[w]] for w in range(len(n))])
    np.testing.assert_array_equal(np.sort(used), np.arange(17 * group))
    assert len(n) == common.num_tiles(T, 5, group, block_m)
    assert (np.asarray(s.pos0)[n > 0] >= 0).all()


def test_all_padding_batch_is_zero():
    case = next(cases(0, kv_heads=2, group=2, head_dim=64, block_size=8, dtype=jnp.float32))
    cu = np.zeros_like(case.cu_q_lens)
    seq = np.zeros_like(case.seq_lens)
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=0.125, interpret=True),
                 compiler_options=FAST_COMPILE)
    out = fn(case.q, case.k_cache, case.v_cache, jnp.asarray(cu), jnp.asarray(seq),
             jnp.asarray(case.block_tables))
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("platform,variant", [("cuda", "gpu"), ("tpu", "tpu")])
def test_lowers_for_accelerators(platform, variant, monkeypatch):
    """Pallas -> Triton IR / Mosaic lowering at Llama-3-8B head shapes, without hardware.

    Checks the lowering rules only (not the Triton/Mosaic compilers); the device
    check script runs the real thing.
    """
    from jax import export
    if platform == "tpu":  # Mosaic lowering asks for chip info; pretend to be a v5e
        pretend_tpu_v5e(monkeypatch)
    sds = jax.ShapeDtypeStruct
    K, N, H, bs, T, R, P, NB = 8, 32, 128, 16, 64, 8, 16, 256
    args = (sds((T, N, H), jnp.bfloat16), sds((K, NB, bs, H), jnp.bfloat16),
            sds((K, NB, bs, H), jnp.bfloat16), sds((R + 1,), jnp.int32),
            sds((R,), jnp.int32), sds((R, P), jnp.int32))
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=H ** -0.5, backend=variant,
                                   sliding_window=128, soft_cap=30.0))
    checks = [export.DisabledSafetyCheck.custom_call(t)
              for t in ("__gpu$xla.gpu.triton", "tpu_custom_call")]
    target = export_target.cuda() if platform == "cuda" else contextlib.nullcontext()
    with target:    # jax 0.11's Triton lowering asks for a GPU: name one
        text = export.export(fn, platforms=[platform], disabled_checks=checks)(*args)
    assert ("xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text.mlir_module()


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_kv_head_offset_reads_one_head_of_a_wider_cache(variant):
    """A tensor-parallel shard of a replicated cache: 2 of the 4 query heads of KV head 1
    read k_cache[1] by offset; equal to those heads of the whole-batch float64 ref."""
    case = next(cases(5, kv_heads=2, group=4, head_dim=64, block_size=8, dtype=jnp.float32))
    scale, n = 0.125, case.num_real_tokens
    want = ragged_paged_attention_ref(case.q, case.k_cache, case.v_cache, case.cu_q_lens,
                                      case.seq_lens, case.block_tables, scale=scale)
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=scale, interpret=True,
                                   backend=variant), compiler_options=FAST_COMPILE)
    q, *rest = case.kernel_args()
    out = fn(q[:, 6:8], *rest, kv_head_offset=jnp.int32(1))
    assert out.shape == (q.shape[0], 2, q.shape[2])
    np.testing.assert_allclose(np.asarray(out[:n]), want[:n, 6:8], **dict(zip(
        ("atol", "rtol"), TOL[jnp.float32])))
