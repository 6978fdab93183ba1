"""Weight-only matmul on llama.cpp's GGUF block formats for small row counts (decode):
out = x @ W.T with W [N, K] kept as the file's blocks, dequantized tile by tile on chip.

    kind   parts (HF orientation: one row per output channel)         W
    q8_0   q int8 [N, K/32, 32], d f16 [N, K/32]                      d * q
    q4_0   p uint8 [N, K/32, 16], d                                   d * (nibble - 8)
    q4_1   p, d, m f16 [N, K/32]                                      d * nibble + m
    q4_k   p uint8 [N, K/64, 32], d / dmin f16 [N, K/256],            d*sc * nibble
           sc / mn uint8 [N, K/32] (one per 32 values)                  - dmin*mn

Byte j of a 4-bit group holds value j in its low nibble and value j + half in its high
one (half = 16 for Q4_0 / Q4_1's 32-value blocks, 32 for Q4_K's 64-value groups). The
kernel never interleaves nibbles back into K order (Triton can only join along a new
last axis of size 2): x is split instead, in the wrapper, into the two halves each
nibble multiplies ("streams": x_lo [M, K/2] with x's values j of every group, x_hi with
values j + half), and each stream is one dot against the packed bytes' low or high
nibbles. Per stream a block's scale (and offset) cover 16 (Q4_0 / Q4_1) or 32 (Q4_K)
consecutive bytes; Q8_0 is one stream over K with 32-value blocks. Scales are widened
to the values on chip (broadcast along a new last axis, then merged into it), in
float32 as model/quant.py's reference dequantization does, and the tile is cast to x's
dtype for the dot (float32 accumulation).

Q4_K's sub-block scales interleave the two streams (sub-block 2g is group g's low
nibbles, 2g + 1 its high ones); the wrapper splits sc and mn by stream (two uint8
arrays of N * K/64 bytes each, 1/36 of the weight's bytes). Every other part reaches
the kernel as it is stored, reshaped only (q and p as 2-D [N, K] and [N, K/2] views).

Bodies as kernel.py's: TPU, grid over N with the whole of K in each block (a scale
block must be the whole K axis or 128 lanes of it, and Q4_K's d has K/256 columns);
GPU (Triton), grid over N and a loop over K in power-of-two chunks with masked loads.
Neither has run on a chip (tests run them in interpret mode and lower them with
jax.export); block sizes are in tuning.py.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.quant_matmul import tuning

KERNEL_NAME = "quant_matmul_blocks"
KINDS = ("q8_0", "q4_0", "q4_1", "q4_k")
_NT = (((1,), (1,)), ((), ()))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# stream columns one scale covers, per kind
PER_BLOCK = {"q8_0": 32, "q4_0": 16, "q4_1": 16, "q4_k": 32}


def _widen(s: jax.Array, times: int) -> jax.Array:
    """[R, B] -> [R, B * times], each column repeated `times` times (on chip)."""
    r, b = s.shape
    return jnp.broadcast_to(s[:, :, None], (r, b, times)).reshape(r, b * times)


def _stream_tile(kind: str, stream: int, v: jax.Array, scales: dict[str, jax.Array],
                 dtype: Any) -> jax.Array:
    """One stream's weight tile [R, C] in `dtype` from its stored values v [R, C] and
    the scale tiles covering the same columns (float32 math)."""
    f32 = jnp.float32
    if kind == "q8_0":
        return (v.astype(f32) * _widen(scales["d"].astype(f32), 32)).astype(dtype)
    nib = (v & 15) if stream == 0 else (v >> 4)
    n = nib.astype(jnp.int32).astype(f32)
    if kind == "q4_0":
        return ((n - 8.0) * _widen(scales["d"].astype(f32), 16)).astype(dtype)
    if kind == "q4_1":
        return (n * _widen(scales["d"].astype(f32), 16)
                + _widen(scales["m"].astype(f32), 16)).astype(dtype)
    # q4_k: per 32-value sub-block d * sc and dmin * mn, d and dmin per 8 sub-blocks
    # (4 groups of a stream)
    sc = scales["sc"].astype(jnp.int32).astype(f32)
    mn = scales["mn"].astype(jnp.int32).astype(f32)
    scale = _widen(scales["d"].astype(f32), 4) * sc
    off = _widen(scales["dmin"].astype(f32), 4) * mn
    return (n * _widen(scale, 32) - _widen(off, 32)).astype(dtype)


def _scale_names(kind: str) -> tuple[str, ...]:
    return {"q8_0": ("d",), "q4_0": ("d",), "q4_1": ("d", "m"),
            "q4_k": ("d", "dmin", "sc0", "sc1", "mn0", "mn1")}[kind]


def _stream_scales(kind: str, stream: int, s: dict[str, jax.Array]) -> dict[str, jax.Array]:
    if kind != "q4_k":
        return s
    return {"d": s["d"], "dmin": s["dmin"], "sc": s[f"sc{stream}"], "mn": s[f"mn{stream}"]}


def _tpu_body(*refs, kind: str, streams: int, names: tuple[str, ...]):
    xs, v_ref = refs[:streams], refs[streams]
    s_refs = dict(zip(names, refs[streams + 1:streams + 1 + len(names)]))
    o_ref = refs[-1]
    v = v_ref[...]
    s = {k: r[...] for k, r in s_refs.items()}
    acc = None
    for i, x_ref in enumerate(xs):
        w = _stream_tile(kind, i, v, _stream_scales(kind, i, s), x_ref.dtype)
        part = lax.dot_general(x_ref[...], w, _NT, preferred_element_type=jnp.float32)
        acc = part if acc is None else acc + part
    o_ref[...] = acc.astype(o_ref.dtype)


def _gpu_body(*refs, kind: str, streams: int, names: tuple[str, ...], n_total: int,
              cols: int, chunk: int, per_block: int, widths: tuple[int, ...]):
    """cols: stream columns (K or K/2); chunk: stream columns per loop step (a power of
    two and a multiple of per_block, the stream columns one scale covers); widths: the
    scale arrays' columns (a block may reach past them: loads are masked)."""
    xs, v_ref = refs[:streams], refs[streams]
    s_refs = dict(zip(names, refs[streams + 1:streams + 1 + len(names)]))
    o_ref = refs[-1]
    rows, bn = o_ref.shape
    first = pl.program_id(0) * bn
    chan = first + lax.broadcasted_iota(jnp.int32, (bn, chunk), 0)
    lane = lax.broadcasted_iota(jnp.int32, (bn, chunk), 1)
    nsc = chunk // per_block

    def scale_tile(name: str, start_col: int, width: int) -> jax.Array:
        c = first + lax.broadcasted_iota(jnp.int32, (bn, width), 0)
        j = start_col + lax.broadcasted_iota(jnp.int32, (bn, width), 1)
        total = widths[names.index(name)]
        return plgpu.load(s_refs[name].at[:, pl.ds(start_col, width)],
                          mask=(c < n_total) & (j < total), other=0)

    def step(kb, acc):
        start = kb * chunk
        ok = (chan < n_total) & (start + lane < cols)
        v = plgpu.load(v_ref.at[:, pl.ds(start, chunk)], mask=ok, other=0)
        s = {}
        for name in names:
            if kind == "q4_k" and name in ("d", "dmin"):   # one per 4 stream blocks
                s[name] = scale_tile(name, kb * (nsc // 4), nsc // 4)
            else:
                s[name] = scale_tile(name, kb * nsc, nsc)
        for i, x_ref in enumerate(xs):
            w = _stream_tile(kind, i, v, _stream_scales(kind, i, s), x_ref.dtype)
            acc = acc + lax.dot_general(x_ref[:, pl.ds(start, chunk)], w, _NT,
                                        preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, _cdiv(cols, chunk), step, jnp.zeros((rows, bn), jnp.float32))
    out_ok = first + lax.broadcasted_iota(jnp.int32, (rows, bn), 1) < n_total
    plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=out_ok)


def operands(x: jax.Array, kind: str, parts: dict[str, jax.Array]
             ) -> tuple[list[jax.Array], jax.Array, dict[str, jax.Array]]:
    """(x's streams [M, C] each, the values as a 2-D [N, C] view, the scales by the
    kernel's names) for x [M, K] and one weight's parts."""
    m, k = x.shape
    if kind == "q8_0":
        q = parts["q"]
        return [x], q.reshape(q.shape[0], -1), {"d": parts["d"]}
    p = parts["p"]
    half = p.shape[-1]                       # 16 (Q4_0 / Q4_1) or 32 (Q4_K)
    g = x.reshape(m, k // (2 * half), 2, half)
    xs = [g[:, :, 0, :].reshape(m, k // 2), g[:, :, 1, :].reshape(m, k // 2)]
    v = p.reshape(p.shape[0], -1)
    if kind == "q4_0":
        return xs, v, {"d": parts["d"]}
    if kind == "q4_1":
        return xs, v, {"d": parts["d"], "m": parts["m"]}
    n = p.shape[0]
    sc = parts["sc"].reshape(n, -1, 2)
    mn = parts["mn"].reshape(n, -1, 2)
    return xs, v, {"d": parts["d"], "dmin": parts["dmin"], "sc0": sc[:, :, 0],
                   "sc1": sc[:, :, 1], "mn0": mn[:, :, 0], "mn1": mn[:, :, 1]}


def part_layout(kind: str, n: int, k: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype name) of each part of an [n, k] matrix in `kind`'s blocks (the
    module docstring's table)."""
    b = k // 32
    if kind == "q8_0":
        return [("q", (n, b, 32), "int8"), ("d", (n, b), "float16")]
    if kind in ("q4_0", "q4_1"):
        out = [("p", (n, b, 16), "uint8"), ("d", (n, b), "float16")]
        return out + ([("m", (n, b), "float16")] if kind == "q4_1" else [])
    if kind == "q4_k":
        return [("p", (n, k // 64, 32), "uint8"), ("d", (n, k // 256), "float16"),
                ("dmin", (n, k // 256), "float16"), ("sc", (n, b), "uint8"),
                ("mn", (n, b), "uint8")]
    raise ValueError(f"block_matmul: unknown kind {kind!r}")


def check_parts(kind: str, parts: dict[str, jax.Array], n: int, k: int) -> None:
    group = 256 if kind == "q4_k" else 32
    want = {name: shape for name, shape, _ in part_layout(kind, n, k)}
    got = {name: tuple(a.shape) for name, a in parts.items()}
    if k % group or got != want:
        raise ValueError(f"block_matmul: {kind} parts {got} do not fit a [{n}, {k}] "
                         f"weight (want {want}, K a multiple of {group})")


def tpu_block_n(n: int, k: int) -> int:
    """Output channels per TPU block: the whole K is in VMEM, so the block shrinks as K
    grows (tuning.BLOCK_TILE_BYTES of float32 tile), in multiples of 128 (a block of
    the output's last axis), or all of N."""
    bn = max(128, (tuning.BLOCK_TILE_BYTES // (4 * k)) // 128 * 128)
    bn = min(bn, tuning.BLOCKS["tpu"][0])
    return n if n <= bn else bn


@functools.partial(jax.jit, static_argnames=("kind", "n", "backend", "interpret", "block_n"))
def block_matmul(x: jax.Array, parts: dict[str, jax.Array], *, kind: str, n: int,
                 backend: str, interpret: bool = False,
                 block_n: int | None = None) -> jax.Array:
    """x [M, K] @ W.T -> [M, n] in x's dtype, W [n, K] given by its GGUF block parts (the
    module docstring). block_n: output channels per program (default: tuning)."""
    if backend not in ("tpu", "gpu"):
        raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
    if kind not in KINDS:
        raise ValueError(f"block_matmul: unknown kind {kind!r}")
    m, k = x.shape
    check_parts(kind, parts, n, k)
    xs, v, scales = operands(x, kind, parts)
    names = _scale_names(kind)
    streams, cols = len(xs), v.shape[1]
    per_block = PER_BLOCK[kind]
    rows = _cdiv(m, tuning.ROW_ALIGN) * tuning.ROW_ALIGN
    out_shape = jax.ShapeDtypeStruct((rows, n), x.dtype)
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        bn = block_n or tpu_block_n(n, k)
        xs_p = [jnp.pad(a, ((0, rows - m), (0, 0))) for a in xs]
        full = lambda a: pl.BlockSpec((bn, a.shape[1]), lambda i: (i, 0))   # noqa: E731
        out = pl.pallas_call(
            functools.partial(_tpu_body, kind=kind, streams=streams, names=names),
            grid=(_cdiv(n, bn),),
            in_specs=[*(pl.BlockSpec((rows, cols), lambda i: (0, 0)) for _ in xs_p),
                      full(v), *(full(scales[nm]) for nm in names)],
            out_specs=pl.BlockSpec((rows, bn), lambda i: (0, i)),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel",),
                vmem_limit_bytes=tuning.BLOCK_VMEM_LIMIT),
            interpret=interpret, name=KERNEL_NAME)(*xs_p, v, *(scales[nm] for nm in names))
        return out[:m]
    bn = block_n or tuning.BLOCKS["gpu"][0]
    chunk = tuning.GPU_BLOCK_CHUNK[kind]
    cp = _cdiv(cols, chunk) * chunk
    xs_p = [jnp.pad(a, ((0, rows - m), (0, cp - cols))) for a in xs]   # zeros: finite * 0
    params = None
    if not interpret:
        params = plgpu.CompilerParams(num_warps=tuning.GPU_NUM_WARPS,
                                      num_stages=tuning.GPU_NUM_STAGES)
    scale_cols = {nm: _cdiv(cp, per_block * (4 if kind == "q4_k" and nm in ("d", "dmin")
                                            else 1)) for nm in names}
    out = pl.pallas_call(
        functools.partial(_gpu_body, kind=kind, streams=streams, names=names, n_total=n,
                          cols=cols, chunk=chunk, per_block=per_block,
                          widths=tuple(scales[nm].shape[1] for nm in names)),
        grid=(_cdiv(n, bn),),
        in_specs=[*(pl.BlockSpec((rows, cp), lambda i: (0, 0)) for _ in xs_p),
                  pl.BlockSpec((bn, cp), lambda i: (i, 0)),
                  *(pl.BlockSpec((bn, scale_cols[nm]), lambda i: (i, 0)) for nm in names)],
        out_specs=pl.BlockSpec((rows, bn), lambda i: (0, i)),
        out_shape=out_shape, compiler_params=params,
        interpret=interpret, name=KERNEL_NAME)(*xs_p, v, *(scales[nm] for nm in names))
    return out[:m]
