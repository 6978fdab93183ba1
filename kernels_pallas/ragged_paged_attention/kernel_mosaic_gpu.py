"""Mosaic GPU (Hopper) variant of the paged GPU kernel, for decode buckets.

    ragged_paged_attention_mgpu(q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables,
                                *, scale, sliding_window=None, soft_cap=None,
                                interpret=False, tiles=None) -> [T, N, H]

Same contract as kernel.ragged_paged_attention (bf16/fp16 caches, no quantized cache).
Pallas' Triton backend is deprecated from jax 0.11; this is the same page-by-page
design on `jax.experimental.pallas.mosaic_gpu` (`plgpu.kernel`, the entry point that
lowers on jax 0.10 and 0.11 alike):

  * one program per (kv head, one-token tile): a tile holds the token's G query heads,
    padded to the 64 rows of a Hopper warpgroup MMA (WGMMA);
  * the tile's pages stream through a two-slot shared-memory ring by TMA
    (`copy_gmem_to_smem` of one whole [bs, H] page per copy, the table entry read from
    global memory as a scalar): page j+1's K and V are in flight while page j is
    computed;
  * S = Q K^T and O += P V run on WGMMA (K read transposed in shared memory, P from
    registers), the online softmax in float32 registers.

Any layout is correct (every token is its own tile), but only decode buckets use it
well: a prefill chunk would reread its context once per token. Pages must hold a
multiple of 64 slots (the WGMMA tile), head_dim a multiple of 64. Lowered for CUDA and
checked in the Mosaic GPU interpreter; never compiled or run on a GPU.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.ragged_paged_attention import common
from kernels_pallas.ragged_paged_attention import kernel_paged as kp

ROWS = 64          # WGMMA M: query rows per program
SLOTS = 2          # pages in flight per program


def interpret_params() -> Any:
    """The Mosaic GPU interpreter (simulated shared memory, TMA copies and barriers)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:      # jax 0.10 has it, not yet exported
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        params = InterpretGPUParams
    return params()


def _smem_transforms(dtype) -> tuple:
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _kernel(row_ref, pos_ref, n_ref, bt_ref, q_ref, k_ref, v_ref, o_ref,
            q_smem, k_smem, v_smem, k_barriers, v_barriers, q_barrier, *,
            sliding_window: int | None, soft_cap: float | None, interpret: bool):
    kv = jax.lax.axis_index("kv")
    w = jax.lax.axis_index("tile")
    bs, head_dim = k_smem.shape[1], k_smem.shape[2]
    dtype = q_smem.dtype
    row, pos, n = row_ref[w], pos_ref[w], n_ref[w]     # pos: the token's position
    hi = jnp.where(n > 0, pos + 1, 0)
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    lo = jnp.minimum(lo, hi)
    p0 = jax.lax.div(lo, jnp.int32(bs))
    p1 = jax.lax.div(hi + bs - 1, jnp.int32(bs))

    plgpu.copy_gmem_to_smem(q_ref.at[kv, w], q_smem, q_barrier)

    def fetch(j, slot):
        page = bt_ref[row, j]
        plgpu.copy_gmem_to_smem(k_ref.at[kv, page], k_smem.at[slot], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[kv, page], v_smem.at[slot], v_barriers.at[slot])

    @pl.when(p0 < p1)
    def _():
        fetch(p0, 0)

    def layout(x, wgmma_layout):    # register layouts mean nothing to the interpreter
        return x if interpret else plgpu.layout_cast(x, wgmma_layout)

    plgpu.barrier_wait(q_barrier)
    m0 = layout(jnp.full((ROWS,), common.MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l0 = layout(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc0 = layout(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def body(j, carry):
        acc, m_prev, l_prev = carry
        slot = jax.lax.rem(j - p0, jnp.int32(SLOTS))

        @pl.when(j + 1 < p1)
        def _():
            fetch(j + 1, 1 - slot)

        plgpu.barrier_wait(k_barriers.at[slot])

        if interpret:       # the interpreter has no WGMMA: the same product as a dot
            s = jax.lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        else:
            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((ROWS, bs), jnp.float32))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if interpret:
            iota = jax.lax.broadcasted_iota(jnp.int32, (ROWS, bs), 1)
        else:
            iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, bs), 1, layout=plgpu.Layout.WGMMA)
        kv_pos = j * bs + iota
        visible = (kv_pos >= lo) & (kv_pos < hi)
        s = jnp.where(visible, s, common.MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - jax.lax.broadcast_in_dim(m_next, s.shape, [0]))
        l_next = l_prev * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

        plgpu.barrier_wait(v_barriers.at[slot])

        if interpret:
            acc = acc + jax.lax.dot_general(p.astype(dtype), v_smem[slot],
                                            (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        else:
            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        return acc, m_next, l_next

    acc, _, l = jax.lax.fori_loop(p0, p1, body, (acc0, m0, l0))
    l = jnp.where(l == 0.0, 1.0, l)
    q_smem[...] = (acc / jax.lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[kv, w])
    plgpu.wait_smem_to_gmem(0)


def _mgpu_call(q_tiles, k_cache, v_cache, row, pos, n, block_tables, *,
               sliding_window, soft_cap, interpret):
    K, W, M, H = q_tiles.shape
    _, _, bs, _ = k_cache.shape
    dtype = q_tiles.dtype
    transforms = _smem_transforms(dtype)
    kernel = functools.partial(_kernel, sliding_window=sliding_window, soft_cap=soft_cap,
                               interpret=interpret)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, dtype),
        scratch_types=[
            plgpu.SMEM((M, H), dtype, transforms=transforms),
            plgpu.SMEM((SLOTS, bs, H), dtype, transforms=transforms),
            plgpu.SMEM((SLOTS, bs, H), dtype, transforms=transforms),
            plgpu.Barrier(num_barriers=SLOTS),
            plgpu.Barrier(num_barriers=SLOTS),
            plgpu.Barrier(),
        ],
        grid=(K, W),
        grid_names=("kv", "tile"),
        interpret=interpret_params() if interpret else False,
    )(row, pos, n, block_tables, q_tiles, k_cache, v_cache)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap",
                                             "interpret"))
def ragged_paged_attention_mgpu(q: jax.Array, k_cache: Any, v_cache: Any,
                                cu_q_lens: jax.Array, seq_lens: jax.Array,
                                block_tables: jax.Array, *, scale: float,
                                sliding_window: int | None = None,
                                soft_cap: float | None = None, interpret: bool = False,
                                tiles: kp.StepTiles | None = None) -> jax.Array:
    """See the module docstring. tiles: one-token StepTiles (block_t 1), else built here."""
    T, N, H = q.shape
    K, _, bs, _ = k_cache.shape
    group = N // K
    assert group <= ROWS and bs % 64 == 0 and H % 64 == 0, (group, bs, H)
    assert not hasattr(k_cache, "scales"), "quantized caches: use kernel_paged"
    R = seq_lens.shape[0]
    if tiles is None or tiles.block_t != 1:
        tiles = kp.make_step_tiles(cu_q_lens, seq_lens, T, 1)
    q_tiles = kp.pack_q(q, tiles, K, ROWS, scale)
    block_tables = block_tables.astype(jnp.int32)
    if block_tables.shape[1] == 0:
        block_tables = jnp.zeros((R, 1), jnp.int32)
    out = _mgpu_call(q_tiles, k_cache, v_cache, tiles.row, tiles.pos0 + tiles.t0,
                     tiles.nt, block_tables, sliding_window=sliding_window,
                     soft_cap=soft_cap, interpret=interpret)
    return kp.unpack_out(out, tiles, T, group)
