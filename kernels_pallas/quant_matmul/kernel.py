"""Weight-only int8 matmul for small row counts (decode): out = x @ (q * scale).T.

    x [M, K] (bf16 / f32), q [N, K] int8 (HF orientation: one row per output channel),
    scale [N] f32 (per output channel)  ->  [M, N] in x's dtype

The int8 tile of the weight is copied from HBM into VMEM (TPU) or registers / shared
memory (Triton on GPU), widened there to x's dtype and multiplied with float32
accumulation; the per-channel scale multiplies the finished accumulator (one multiply
per output instead of one per weight). The float weight therefore exists only
tile by tile on chip, and HBM traffic is the int8 bytes plus the scales.

Two bodies, one per backend, both runnable in Pallas interpret mode:
  tpu  grid (N blocks, K blocks), K last and sequential; a float32 VMEM accumulator is
       zeroed at the first K block and scaled and stored at the last.
  gpu  grid (N blocks,); each program loops over K in register tiles (Triton has no
       sequential grid axis), loads masked at the matrix's edges.
Shapes need not be multiples of the blocks: x is zero-padded (rows to ROW_ALIGN,
columns to the K blocks; x is small), the weight never is (a padded copy of it is the
HBM buffer this kernel exists to avoid): its edge tiles are masked in the kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.quant_matmul import tuning

KERNEL_NAME = "quant_matmul_int8"
BACKENDS = ("tpu", "gpu")
_NT = (((1,), (1,)), ((), ()))          # contract both operands' last axis: x . w.T


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def blocks_for(backend: str, n: int, k: int,
               blocks: tuple[int, int] | None = None) -> tuple[int, int]:
    """(block_n, block_k) for an [n, k] weight: the tuned blocks, cut down to the
    matrix. TPU: a block equal to the whole dimension is always legal, others are
    multiples of 128. GPU: powers of two (Triton), at least ROW_ALIGN."""
    bn, bk = blocks or tuning.BLOCKS[backend]
    if backend == "tpu":
        return (n if n <= bn else bn), (k if k <= bk else bk)
    floor = tuning.ROW_ALIGN
    return (max(floor, min(bn, _pow2_at_least(n))), max(floor, min(bk, _pow2_at_least(k))))


def _tpu_body(x_ref, q_ref, s_ref, o_ref, acc_ref, *, k_total: int):
    kb = pl.program_id(1)
    block_k = q_ref.shape[1]

    @pl.when(kb == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    w = q_ref[...].astype(x_ref.dtype)                      # widened in VMEM
    if k_total % block_k:                                   # the last K block's tail
        col = kb * block_k + lax.broadcasted_iota(jnp.int32, w.shape, 1)
        w = jnp.where(col < k_total, w, jnp.zeros_like(w))
    acc_ref[...] += lax.dot_general(x_ref[...], w, _NT, preferred_element_type=jnp.float32)

    @pl.when(kb == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = (acc_ref[...] * s_ref[...]).astype(o_ref.dtype)


def _gpu_body(x_ref, q_ref, s_ref, o_ref, *, n_total: int, k_total: int, block_k: int):
    rows, bn = o_ref.shape
    chan = pl.program_id(0) * bn + lax.broadcasted_iota(jnp.int32, (bn, block_k), 0)
    lane = lax.broadcasted_iota(jnp.int32, (bn, block_k), 1)

    def step(kb, acc):
        start = kb * block_k
        ok = (chan < n_total) & (start + lane < k_total)
        w = plgpu.load(q_ref.at[:, pl.ds(start, block_k)], mask=ok, other=0)
        xk = x_ref[:, pl.ds(start, block_k)]
        return acc + lax.dot_general(xk, w.astype(xk.dtype), _NT,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, step,
                        jnp.zeros((rows, bn), jnp.float32))
    first = pl.program_id(0) * bn
    out_ok = first + lax.broadcasted_iota(jnp.int32, (rows, bn), 1) < n_total
    s = plgpu.load(s_ref, mask=first + lax.broadcasted_iota(jnp.int32, (1, bn), 1) < n_total,
                   other=0.0)
    plgpu.store(o_ref, (acc * s).astype(o_ref.dtype), mask=out_ok)


@functools.partial(jax.jit, static_argnames=("backend", "interpret", "blocks"))
def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, backend: str,
                interpret: bool = False, blocks: tuple[int, int] | None = None) -> jax.Array:
    """x [M, K] @ (q [N, K] * scale [N, None]).T -> [M, N] (x's dtype); see the module
    docstring. blocks: (block_n, block_k) instead of tuning.BLOCKS[backend]."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    (m, k), n = x.shape, q.shape[0]
    if q.shape != (n, k) or q.dtype != jnp.int8 or scale.shape != (n,):
        raise ValueError(f"int8_matmul: x {x.shape}, q {q.shape} {q.dtype}, "
                         f"scale {scale.shape} do not fit")
    bn, bk = blocks_for(backend, n, k, blocks)
    rows = _cdiv(m, tuning.ROW_ALIGN) * tuning.ROW_ALIGN
    kp = _cdiv(k, bk) * bk
    xp = jnp.pad(x, ((0, rows - m), (0, kp - k)))           # zeros: finite * 0 = 0
    s2 = scale.astype(jnp.float32).reshape(1, n)
    out_shape = jax.ShapeDtypeStruct((rows, n), x.dtype)
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        out = pl.pallas_call(
            functools.partial(_tpu_body, k_total=k),
            grid=(_cdiv(n, bn), kp // bk),
            in_specs=[pl.BlockSpec((rows, bk), lambda i, j: (0, j)),
                      pl.BlockSpec((bn, bk), lambda i, j: (i, j)),
                      pl.BlockSpec((1, bn), lambda i, j: (0, i))],
            out_specs=pl.BlockSpec((rows, bn), lambda i, j: (0, i)),
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM((rows, bn), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary")),
            interpret=interpret, name=KERNEL_NAME)(xp, q, s2)
    else:
        params = None
        if not interpret:
            params = plgpu.CompilerParams(num_warps=tuning.GPU_NUM_WARPS,
                                          num_stages=tuning.GPU_NUM_STAGES)
        out = pl.pallas_call(
            functools.partial(_gpu_body, n_total=n, k_total=k, block_k=bk),
            grid=(_cdiv(n, bn),),
            in_specs=[pl.BlockSpec((rows, kp), lambda i: (0, 0)),
                      pl.BlockSpec((bn, kp), lambda i: (i, 0)),
                      pl.BlockSpec((1, bn), lambda i: (0, i))],
            out_specs=pl.BlockSpec((rows, bn), lambda i: (0, i)),
            out_shape=out_shape, compiler_params=params,
            interpret=interpret, name=KERNEL_NAME)(xp, q, s2)
    return out[:m]
