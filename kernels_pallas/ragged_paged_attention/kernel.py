"""Ragged paged attention: one Pallas kernel for a flat batch of mixed prefill
chunks and decode tokens reading a paged KV cache.

    ragged_paged_attention(q [T, N, H], k_cache/v_cache [K, NB, bs, H],
                           cu_q_lens [R+1], seq_lens [R], block_tables [R, P])
        -> [T, N, H]

Row r owns tokens T[cu_q_lens[r]:cu_q_lens[r+1]] and attends over KV slots
0 .. seq_lens[r]-1 (context and its own new tokens, already written to the
cache), found through block_tables[r]. The query token i of a row with q_len
tokens sits at position seq_len - q_len + i and sees keys at positions <= its
own (and > its own - sliding_window). Tokens of no row and rows with q_len 0
give zeros.

Two variants behind one function, chosen by `jax.default_backend()`:
  * GPU (Triton) and CPU interpret: this file. Grid (K, W tiles); the kernel
    gathers K/V slot by slot through the block table (pointer gathers are free
    on Triton), BK slots per step of an online softmax.
  * TPU (Mosaic): kernel_tpu.py. Block tables are scalar-prefetched and each
    grid step DMAs `pages_per_step` pages chosen by the BlockSpec index maps.
See common.py for the query tiling and docs/kernels.md for tuning.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.ragged_paged_attention import common


def load_slots(ref, scale_ref, head, pages, offs, dtype):
    """common.load_kv, optionally from head `head` of a whole [K, NB, bs, H] cache: the
    head and the slots in one indexer (Triton lowers no chained ref indexers)."""
    if head is None:
        return common.load_kv(ref, scale_ref, pages, offs, dtype)
    x = ref[head, pages, offs, :]
    if scale_ref is None:
        return x.astype(dtype)
    s = scale_ref[head, pages, offs]
    return (x.astype(jnp.float32) * common.bcast_col(s, x.shape)).astype(dtype)


def _gpu_kernel(row_ref, f0_ref, n_ref, pos0_ref,    # [W] int32 tile schedule
                bt_ref,                              # [R, P] int32 block tables
                q_ref,                               # [M, H] this tile's (scaled) queries
                k_ref, v_ref,                        # [NB, bs, H] this kv head's pool
                *rest,                               # (k/v scales [NB, bs],) ([1] kv head
                                                     # offset,) o_ref [M, H]
                group: int, block_kv: int, sliding_window: int | None,
                soft_cap: float | None, quantized: bool = False):
    w = pl.program_id(1)
    row, f0, n, pos0 = row_ref[w], f0_ref[w], n_ref[w], pos0_ref[w]
    block_m, head_dim = q_ref.shape
    o_ref = rest[-1]
    ks_ref, vs_ref = rest[:2] if quantized else (None, None)
    head = None
    if len(rest) - 2 * quantized == 2:   # whole [K, NB, bs, H] caches: pick the head by offset
        head = rest[-2][0] + pl.program_id(0)
    bs = k_ref.shape[-2]
    max_page = bt_ref.shape[1] - 1
    q = q_ref[...]
    lo, hi = common.kv_range(f0, n, pos0, group, sliding_window)

    def body(j, carry):
        kv_pos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)      # [BK]
        pages = bt_ref[row, jnp.minimum(kv_pos // bs, max_page)]
        k = load_slots(k_ref, ks_ref, head, pages, kv_pos % bs, q.dtype)   # [BK, H]
        v = load_slots(v_ref, vs_ref, head, pages, kv_pos % bs, q.dtype)
        mask = common.tile_mask(f0, n, pos0, kv_pos, group, block_m, sliding_window)
        return common.online_softmax_step(q, k, v, mask, *carry, soft_cap)

    m0 = jnp.full((block_m,), common.MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((block_m,), jnp.float32)
    acc0 = jnp.zeros((block_m, head_dim), jnp.float32)
    _, l, acc = jax.lax.fori_loop(lo // block_kv, pl.cdiv(hi, block_kv), body, (m0, l0, acc0))
    l = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / common.bcast_col(l, acc.shape)).astype(o_ref.dtype)


def _gpu_call(q_tiles, k_cache, v_cache, sched: common.TileSchedule, block_tables, *,
              group, block_kv, sliding_window, soft_cap, num_warps, num_stages, interpret,
              kv_head_offset=None):
    K, W, M, H = q_tiles.shape
    KC, NB, bs, _ = k_cache.shape
    R, P = block_tables.shape
    caches, quantized = common.cache_operands(k_cache, v_cache)
    kernel = functools.partial(_gpu_kernel, group=group, block_kv=block_kv,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               quantized=quantized)
    whole_1d = pl.BlockSpec((W,), lambda k, w: (0,))
    if kv_head_offset is None:
        kv_spec = pl.BlockSpec((None, NB, bs, H), lambda k, w: (k, 0, 0, 0))
        scale_spec = pl.BlockSpec((None, NB, bs), lambda k, w: (k, 0, 0))
        extra_specs, extra = [], []
    else:   # the caches hold more heads than q reads: the kernel indexes them itself
        kv_spec = pl.BlockSpec((KC, NB, bs, H), lambda k, w: (0, 0, 0, 0))
        scale_spec = pl.BlockSpec((KC, NB, bs), lambda k, w: (0, 0, 0))
        extra_specs = [pl.BlockSpec((1,), lambda k, w: (0,))]
        extra = [jnp.reshape(kv_head_offset, (1,)).astype(jnp.int32)]
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        grid=(K, W),
        in_specs=[whole_1d, whole_1d, whole_1d, whole_1d,
                  pl.BlockSpec((R, P), lambda k, w: (0, 0)),
                  pl.BlockSpec((None, None, M, H), lambda k, w: (k, w, 0, 0)),
                  *[kv_spec] * 2, *[scale_spec] * (2 * quantized), *extra_specs],
        out_specs=pl.BlockSpec((None, None, M, H), lambda k, w: (k, w, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(sched.row, sched.f0, sched.n, sched.pos0, block_tables, q_tiles, *caches, *extra)


def default_block_m(variant: str, num_tokens: int, num_rows: int) -> int:
    """Small tiles for decode buckets (few query rows per row), MMA-sized otherwise."""
    if num_tokens <= num_rows:
        return 16
    return 64 if variant == "gpu" else 128


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "interpret", "backend", "block_m", "block_kv",
    "pages_per_step", "num_warps", "num_stages"))
def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           cu_q_lens: jax.Array, seq_lens: jax.Array,
                           block_tables: jax.Array, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           interpret: bool = False, backend: str | None = None,
                           block_m: int | None = None, block_kv: int = 64,
                           pages_per_step: int = 4, num_warps: int = 4,
                           num_stages: int = 2, kv_head_offset: jax.Array | None = None
                           ) -> jax.Array:
    """Ragged paged attention (see the module docstring). Returns [T, N, H] in q.dtype.

    Args:
      q: [T, N, H] queries (unscaled). N must be a multiple of K.
      k_cache, v_cache: [K, NB, bs, H] paged caches holding every row's
        seq_lens[r] keys/values (new tokens included); or quantized caches
        (jaxserve/attention/kv_quant.py QuantizedKV: int8 / fp8 values + [K, NB, bs]
        float32 scales), dequantized as they are read.
      cu_q_lens: [R+1] int32, non-decreasing; row r owns q[cu[r]:cu[r+1]].
      seq_lens: [R] int32 kv length of each row (0 for padding rows).
      block_tables: [R, P] int32 with P * bs >= max(seq_lens).
      scale: softmax scale applied to q (as the jnp reference does).
      sliding_window: keys at positions <= pos - sliding_window are hidden.
      soft_cap: logits become soft_cap * tanh(logits / soft_cap).
      interpret: run the Pallas interpreter (CPU tests).
      backend: "gpu" or "tpu" variant; default: jax.default_backend() (cpu -> gpu variant).
      block_m: query rows (tokens x heads of a kv group) per tile. Default: 16 (the
        smallest Triton MMA) when T <= R (a decode-only bucket), else 64 on GPU and
        128 (the MXU height) on TPU.
      block_kv: KV slots per online-softmax step (GPU variant; power of 2, >= 16).
      pages_per_step: KV pages per grid step (TPU variant).
      num_warps, num_stages: Triton launch parameters (GPU variant).
      kv_head_offset: int32 scalar (traced). Given, every query head reads the one KV
        head k_cache[kv_head_offset] (a tensor-parallel shard whose query heads all sit
        in one GQA group of a replicated cache, see parallel/shard.py).
    """
    T, N, H = q.shape
    K = k_cache.shape[0] if kv_head_offset is None else 1
    assert N % K == 0, (N, K)
    assert k_cache.shape == v_cache.shape and k_cache.shape[-1] == H, (k_cache.shape, H)
    group = N // K
    variant = backend or ("tpu" if jax.default_backend() == "tpu" else "gpu")
    if block_m is None:
        block_m = default_block_m(variant, T, cu_q_lens.shape[0] - 1)
    cu_q_lens, seq_lens, block_tables, sched, q_tiles = common.prepare_inputs(
        q, cu_q_lens, seq_lens, block_tables, kv_heads=K, group=group, block_m=block_m,
        scale=scale)
    if variant == "gpu":
        out = _gpu_call(q_tiles, k_cache, v_cache, sched, block_tables, group=group,
                        block_kv=block_kv, sliding_window=sliding_window, soft_cap=soft_cap,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                        kv_head_offset=kv_head_offset)
    elif variant == "tpu":
        from kernels_pallas.ragged_paged_attention import kernel_tpu
        out = kernel_tpu.tpu_call(q_tiles, k_cache, v_cache, sched, block_tables,
                                  group=group, pages_per_step=pages_per_step,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  interpret=interpret, kv_head_offset=kv_head_offset)
    else:
        raise ValueError(f"unknown ragged_paged_attention backend {variant!r}")
    return common.unpack_out(out, cu_q_lens, sched, T, group, block_m)
