"""TPU (Mosaic) variant of ragged paged attention; called from kernel.py.

Grid (K, W tiles, J = cdiv(P, pages_per_step)). The tile schedule, the
flattened block tables and the first KV head are scalar-prefetched into SMEM, so the BlockSpec index
maps pick which KV pages the pipeline DMAs for each step: `pages_per_step`
separate (bs, H) page operands for K and for V. Steps outside the tile's
visible KV range [lo, hi) clamp to an edge page (the pipeline skips a copy
when the block index repeats) and skip the math. m / l / acc live in VMEM
scratch across the J steps; the output tile is written on the last step.

A quantized cache (jaxserve/attention/kv_quant.py) adds one (1, bs) scale page operand per
K/V page (the scales viewed as [K, NB, 1, bs]: slots on lanes), applied to the scores
(K) and the softmax weights (V) as lane rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention import common

LANES = 128


def _page_index(k, w, j, i, row_ref, f0_ref, n_ref, pos0_ref, bt_ref, head_ref, *,
                num_pages: int, pages_per_step: int, bs: int, group: int,
                sliding_window: int | None):
    lo, hi = common.kv_range(f0_ref[w], n_ref[w], pos0_ref[w], group, sliding_window)
    page = jnp.clip(j * pages_per_step + i, common.idiv(lo, bs),
                    common.idiv(jnp.maximum(hi - 1, lo), bs))
    return head_ref[0] + k, bt_ref[row_ref[w] * num_pages + page], 0, 0


def _step(q, k, v, mask, m_prev, l_prev, acc_prev, soft_cap, k_scale=None, v_scale=None):
    """Online-softmax update with [M, 1] statistics (Mosaic-friendly 2D shapes);
    k_scale / v_scale [1, B]: a quantized page's slot scales."""
    s = jnp.einsum("mh,bh->mb", q, k, preferred_element_type=jnp.float32)
    if k_scale is not None:
        s = s * k_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    l_next = alpha * l_prev + p.sum(axis=1, keepdims=True)
    if v_scale is not None:
        p = p * v_scale
    pv = jnp.einsum("mb,bh->mh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv


def _tpu_kernel(row_ref, f0_ref, n_ref, pos0_ref, bt_ref, head_ref,   # scalar prefetch
                q_ref, *refs, pages_per_step: int, group: int,
                sliding_window: int | None, soft_cap: float | None, quantized: bool = False):
    k_refs = refs[:pages_per_step]
    v_refs = refs[pages_per_step:2 * pages_per_step]
    n_pages = (4 if quantized else 2) * pages_per_step
    ks_refs = refs[2 * pages_per_step:3 * pages_per_step] if quantized else None
    vs_refs = refs[3 * pages_per_step:n_pages] if quantized else None
    o_ref, m_sc, l_sc, acc_sc = refs[n_pages:]
    w, j = pl.program_id(1), pl.program_id(2)
    f0, n, pos0 = f0_ref[w], n_ref[w], pos0_ref[w]
    block_m = q_ref.shape[0]
    bs = k_refs[0].shape[0]
    lo, hi = common.kv_range(f0, n, pos0, group, sliding_window)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, common.MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    step_lo = j * pages_per_step * bs

    @pl.when((step_lo < hi) & (step_lo + pages_per_step * bs > lo))
    def _compute():
        q = q_ref[...]
        m, l, acc = m_sc[...][:, :1], l_sc[...][:, :1], acc_sc[...]
        shape = (block_m, bs)
        q_row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        q_pos = pos0 + common.idiv(f0 + q_row, group)
        for i in range(pages_per_step):
            kv_pos = step_lo + i * bs + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
            mask = (kv_pos <= q_pos) & (q_row < n)
            if sliding_window is not None:
                mask &= kv_pos > q_pos - sliding_window
            scales = (ks_refs[i][...], vs_refs[i][...]) if quantized else (None, None)
            m, l, acc = _step(q, k_refs[i][...].astype(q.dtype), v_refs[i][...].astype(q.dtype),
                              mask, m, l, acc, soft_cap, *scales)
        m_sc[...] = jnp.broadcast_to(m, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l, l_sc.shape)
        acc_sc[...] = acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        l = l_sc[...][:, :1]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def tpu_call(q_tiles, k_cache, v_cache, sched: common.TileSchedule, block_tables, *,
             group: int, pages_per_step: int, sliding_window: int | None,
             soft_cap: float | None, interpret: bool, kv_head_offset=None):
    """q_tiles [K, W, M, H] -> out tiles [K, W, M, H]; tile head k reads cache head
    kv_head_offset + k (offset 0 by default)."""
    K, W, M, H = q_tiles.shape
    bs = k_cache.shape[2]
    R, P = block_tables.shape
    pages_per_step = max(1, min(pages_per_step, P))
    page_map = functools.partial(_page_index, num_pages=P, pages_per_step=pages_per_step,
                                 bs=bs, group=group, sliding_window=sliding_window)
    tile_spec = pl.BlockSpec((None, None, M, H), lambda k, w, j, *_: (k, w, 0, 0))

    def page_map_kw(i):
        return lambda k, w, j, *s: page_map(k, w, j, i, *s)

    page_specs = [pl.BlockSpec((None, None, bs, H), page_map_kw(i))
                  for i in range(pages_per_step)]
    caches, quantized = common.cache_operands(k_cache, v_cache)
    scale_specs, scale_ops = [], []
    if quantized:     # [K, NB, 1, bs]: one (1, bs) lane row per page
        scale_specs = [pl.BlockSpec((None, None, 1, bs), page_map_kw(i))
                       for i in range(pages_per_step)] * 2
        scale_ops = [c.reshape(*c.shape[:2], 1, bs) for c in caches[2:]
                     for _ in range(pages_per_step)]
    kernel = functools.partial(_tpu_kernel, pages_per_step=pages_per_step, group=group,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               quantized=quantized)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(K, W, pl.cdiv(P, pages_per_step)),
            in_specs=[tile_spec, *page_specs, *page_specs, *scale_specs],
            out_specs=tile_spec,
            scratch_shapes=[pltpu.VMEM((M, LANES), jnp.float32),
                            pltpu.VMEM((M, LANES), jnp.float32),
                            pltpu.VMEM((M, H), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(sched.row, sched.f0, sched.n, sched.pos0, block_tables.reshape(R * P),
      jnp.reshape(jnp.int32(0) if kv_head_offset is None else kv_head_offset,
                  (1,)).astype(jnp.int32),
      q_tiles, *([caches[0]] * pages_per_step), *([caches[1]] * pages_per_step), *scale_ops)
