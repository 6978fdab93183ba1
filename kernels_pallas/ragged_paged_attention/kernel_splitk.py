"""Split-K (flash-decoding) GPU variant of ragged paged attention.

    ragged_paged_attention_splitk(q, k_cache, v_cache, cu_q_lens, seq_lens,
                                  block_tables, *, scale, num_splits, ...) -> [T, N, H]

Same contract as kernel.ragged_paged_attention. The plain GPU kernel runs one
program per (kv head, query tile) and walks the tile's whole KV range; with few
rows (a decode bucket of batch 8 has 8 x 8 = 64 programs for 132 SMs on an H200)
most SMs idle and each program streams a long context alone. Here the grid is
(kv head, tile, split): split s walks the s-th of `num_splits` equal runs of the
tile's KV blocks and writes its partial online-softmax state (row max m, sum l,
unnormalised accumulator) in float32; a small XLA reduction combines the splits:

    M = max_s m_s,  w_s = exp(m_s - M),  out = sum_s w_s acc_s / sum_s w_s l_s

Empty splits (short rows) carry m = MASK, l = 0, acc = 0 and weigh nothing. The
split is over the KV axis only, so any tile (decode or prefill) is correct; the
selection rule (`choose_num_splits`) applies it to decode buckets whose
rows x kv heads leave SMs idle.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.ragged_paged_attention import common
from kernels_pallas.ragged_paged_attention.kernel import load_slots

# H100/H200 SM count: the default when no GPU is attached (export from a CPU host).
DEFAULT_NUM_SMS = 132
MAX_SPLITS = 32


def num_sms(platform_default: int = DEFAULT_NUM_SMS) -> int:
    """Streaming multiprocessors of the first GPU, else the H100/H200 count."""
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        return int(getattr(dev, "core_count", platform_default) or platform_default)
    return platform_default


def choose_num_splits(num_tokens: int, num_rows: int, kv_heads: int,
                      sms: int = DEFAULT_NUM_SMS) -> int:
    """Static per-bucket rule: decode buckets (T <= R) whose rows x kv heads programs
    would leave SMs idle get enough splits for ~2 waves (capped); others get 1."""
    work = num_rows * kv_heads
    if num_tokens > num_rows or work >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // work)))


def _splitk_kernel(row_ref, f0_ref, n_ref, pos0_ref,   # [W] int32 tile schedule
                   bt_ref,                             # [R, P] block tables
                   q_ref,                              # [M, H] scaled queries of the tile
                   k_ref, v_ref,                       # [NB, bs, H] (or all heads, see rest)
                   *rest, group: int, block_kv: int, num_splits: int,
                   sliding_window: int | None, soft_cap: float | None,
                   quantized: bool = False):
    # rest: (k/v scales [NB, bs],) ([1] kv head offset,) o_ref, m_ref, l_ref
    o_ref, m_ref, l_ref = rest[-3:]
    w, s = pl.program_id(1), pl.program_id(2)
    ks_ref, vs_ref = rest[:2] if quantized else (None, None)
    head = None
    if len(rest) - 2 * quantized == 4:   # whole caches + kv head offset (replicated TP shard)
        head = rest[-4][0] + pl.program_id(0)
    row, f0, n, pos0 = row_ref[w], f0_ref[w], n_ref[w], pos0_ref[w]
    block_m, head_dim = q_ref.shape
    bs = k_ref.shape[-2]
    max_page = bt_ref.shape[1] - 1
    q = q_ref[...]
    lo, hi = common.kv_range(f0, n, pos0, group, sliding_window)
    b0 = common.idiv(lo, block_kv)
    b1 = common.idiv(hi + block_kv - 1, block_kv)
    per_split = common.idiv(b1 - b0 + num_splits - 1, num_splits)
    j0 = b0 + s * per_split
    j1 = jnp.minimum(j0 + per_split, b1)

    def body(j, carry):
        kv_pos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)      # [BK]
        pages = bt_ref[row, jnp.minimum(common.idiv(kv_pos, bs), max_page)]
        offs = kv_pos % bs
        k = load_slots(k_ref, ks_ref, head, pages, offs, q.dtype)
        v = load_slots(v_ref, vs_ref, head, pages, offs, q.dtype)
        mask = common.tile_mask(f0, n, pos0, kv_pos, group, block_m, sliding_window)
        return common.online_softmax_step(q, k, v, mask, *carry, soft_cap)

    m0 = jnp.full((block_m,), common.MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((block_m,), jnp.float32)
    acc0 = jnp.zeros((block_m, head_dim), jnp.float32)
    m, l, acc = jax.lax.fori_loop(j0, jnp.maximum(j0, j1), body, (m0, l0, acc0))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _splitk_call(q_tiles, k_cache, v_cache, sched: common.TileSchedule, block_tables, *,
                 group, block_kv, num_splits, sliding_window, soft_cap, num_warps,
                 num_stages, interpret, kv_head_offset=None):
    """-> partial (acc [K, W, S, M, H], m [K, W, S, M], l [K, W, S, M]) in float32."""
    K, W, M, H = q_tiles.shape
    KC, NB, bs, _ = k_cache.shape
    R, P = block_tables.shape
    S = num_splits
    caches, quantized = common.cache_operands(k_cache, v_cache)
    kernel = functools.partial(_splitk_kernel, group=group, block_kv=block_kv,
                               num_splits=S, sliding_window=sliding_window,
                               soft_cap=soft_cap, quantized=quantized)
    whole_1d = pl.BlockSpec((W,), lambda k, w, s: (0,))
    if kv_head_offset is None:
        kv_spec = pl.BlockSpec((None, NB, bs, H), lambda k, w, s: (k, 0, 0, 0))
        scale_spec = pl.BlockSpec((None, NB, bs), lambda k, w, s: (k, 0, 0))
        extra_specs, extra = [], []
    else:
        kv_spec = pl.BlockSpec((KC, NB, bs, H), lambda k, w, s: (0, 0, 0, 0))
        scale_spec = pl.BlockSpec((KC, NB, bs), lambda k, w, s: (0, 0, 0))
        extra_specs = [pl.BlockSpec((1,), lambda k, w, s: (0,))]
        extra = [jnp.reshape(kv_head_offset, (1,)).astype(jnp.int32)]
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    stat = pl.BlockSpec((None, None, None, M), lambda k, w, s: (k, w, s, 0))
    return pl.pallas_call(
        kernel,
        grid=(K, W, S),
        in_specs=[whole_1d] * 4 + [pl.BlockSpec((R, P), lambda k, w, s: (0, 0)),
                                   pl.BlockSpec((None, None, M, H), lambda k, w, s: (k, w, 0, 0)),
                                   kv_spec, kv_spec, *[scale_spec] * (2 * quantized),
                                   *extra_specs],
        out_specs=[pl.BlockSpec((None, None, None, M, H), lambda k, w, s: (k, w, s, 0, 0)),
                   stat, stat],
        out_shape=[jax.ShapeDtypeStruct((K, W, S, M, H), jnp.float32),
                   jax.ShapeDtypeStruct((K, W, S, M), jnp.float32),
                   jax.ShapeDtypeStruct((K, W, S, M), jnp.float32)],
        compiler_params=compiler_params,
        interpret=interpret,
        name="ragged_paged_attention_gpu_splitk",
    )(sched.row, sched.f0, sched.n, sched.pos0, block_tables, q_tiles, *caches, *extra)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Partials over axis 2 -> normalised tiles [K, W, M, H] (zeros where l == 0)."""
    m_max = m.max(axis=2, keepdims=True)
    weight = jnp.exp(m - m_max)                                    # [K, W, S, M]
    denom = (weight * l).sum(axis=2)                               # [K, W, M]
    num = (weight[..., None] * acc).sum(axis=2)                    # [K, W, M, H]
    return (num / jnp.where(denom == 0.0, 1.0, denom)[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "interpret", "num_splits", "block_m", "block_kv",
    "num_warps", "num_stages"))
def ragged_paged_attention_splitk(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                  cu_q_lens: jax.Array, seq_lens: jax.Array,
                                  block_tables: jax.Array, *, scale: float,
                                  num_splits: int | None = None,
                                  sliding_window: int | None = None,
                                  soft_cap: float | None = None, interpret: bool = False,
                                  block_m: int = 16, block_kv: int = 64, num_warps: int = 4,
                                  num_stages: int = 2,
                                  kv_head_offset: jax.Array | None = None) -> jax.Array:
    """Split-K ragged paged attention (module docstring); arguments as in
    kernel.ragged_paged_attention. num_splits: None -> choose_num_splits for this
    bucket and the local GPU's SM count."""
    T, N, H = q.shape
    K = k_cache.shape[0] if kv_head_offset is None else 1
    assert N % K == 0 and k_cache.shape == v_cache.shape and k_cache.shape[-1] == H
    group = N // K
    R = seq_lens.shape[0]
    if num_splits is None:
        num_splits = choose_num_splits(T, R, K, num_sms())
    cu_q_lens, seq_lens, block_tables, sched, q_tiles = common.prepare_inputs(
        q, cu_q_lens, seq_lens, block_tables, kv_heads=K, group=group, block_m=block_m,
        scale=scale)
    acc, m, l = _splitk_call(q_tiles, k_cache, v_cache, sched, block_tables, group=group,
                             block_kv=block_kv, num_splits=num_splits,
                             sliding_window=sliding_window, soft_cap=soft_cap,
                             num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                             kv_head_offset=kv_head_offset)
    out = combine_splits(acc, m, l, q.dtype)
    return common.unpack_out(out, cu_q_lens, sched, T, group, block_m)
