"""Quantized weights: pytree leaves that one matmul helper (`matmul`) understands.

A QArray stands for one weight matrix M [rows, cols] in Hugging Face / llama.cpp
orientation (rows = output channels; the model computes x @ M.T), so a GGUF tensor
becomes one without a copy or transpose, and a tied embedding [vocab, hidden] serves
both as a row table (`M[tokens]`) and as the head. Its `parts` (values and scales)
are ordinary arrays, each with its own logical axes (`part_axes`), so sharding,
jit and donation see a plain pytree; `kind` says how to read them:

    int8   q int8 [R, C],             scale f32 [R]        per output channel, symmetric
    fp8    q float8_e4m3fn [R, C],    scale f32 [R]        per output channel
    q8_0   q int8 [R, C/32, 32],      d f16 [R, C/32]      llama.cpp blocks of 32
    q4_0   p uint8 [R, C/32, 16],     d                    two 4-bit values per byte
    q4_1   p, d, m f16 [R, C/32]                           w = d*q + m
    q4_k   p uint8 [R, C/64, 32], d/dmin f16 [R, C/256], sc/mn uint8 [R, C/32]

Packed 4-bit bytes keep llama.cpp's order: byte j of a group holds value j in its low
nibble and value j + half in its high nibble. Everything is dequantized inside the
jitted step (XLA fuses the unpacking into the matmul's operand where it can), except
where a kernel reads the parts itself: the CPU's C++ matmul, and on TPU / GPU the Pallas
int8 matmul of the decode steps (model/linear.py QuantKernelLinear).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

KINDS = ("int8", "fp8", "q8_0", "q4_0", "q4_1", "q4_k")
ACTIVATIONS = ("none", "int8")


@jax.tree_util.register_pytree_with_keys_class
@dataclass(slots=True)
class QArray:
    kind: str
    parts: dict[str, Any]
    shape: tuple[int, int]            # (rows, cols) of the dequantized matrix
    dtype: Any = jnp.float32          # dtype it dequantizes to (the compute dtype)
    act: str = "none"                 # "int8": activations quantized per row, int8 dot
    # mesh axes the matrix's (rows, cols) are split over, set where a sharding plan
    # places it (parallel/shard.py); None: not placed by a plan
    split: tuple[Any, Any] | None = None
    _names: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantization kind {self.kind!r}")
        self._names = tuple(sorted(self.parts))
        self.shape = tuple(int(s) for s in self.shape)

    # ---- pytree ------------------------------------------------------------------------
    def tree_flatten_with_keys(self):
        children = [(jax.tree_util.DictKey(n), self.parts[n]) for n in self._names]
        return children, (self.kind, self._names, self.shape, jnp.dtype(self.dtype).name,
                          self.act, self.split)

    @classmethod
    def tree_unflatten(cls, aux, children):
        kind, names, shape, dtype, act, split = aux
        return cls(kind, dict(zip(names, children)), shape, jnp.dtype(dtype), act, split)

    # ---- array-like reading ------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(p.shape)) * jnp.dtype(p.dtype).itemsize
                   for p in self.parts.values())

    def __getitem__(self, rows: Any) -> jax.Array:
        """Rows (e.g. token ids [T]) dequantized: [T, cols] in self.dtype."""
        taken = {n: jnp.take(p, rows, axis=0) for n, p in self.parts.items()}
        lead = jnp.shape(rows)
        return _dequant(self.kind, taken, self.dtype).reshape(*lead, self.shape[1])

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The whole matrix [rows, cols]."""
        return _dequant(self.kind, self.parts, dtype or self.dtype).reshape(self.shape)

    def map_parts(self, fn: Any) -> "QArray":
        """fn(name, array) -> array, for each part (placing, converting to device)."""
        return QArray(self.kind, {n: fn(n, p) for n, p in self.parts.items()}, self.shape,
                      self.dtype, self.act, self.split)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QArray)


def _unpack4(p: jax.Array) -> jax.Array:
    """uint8 [..., half] -> [..., 2*half]: low nibbles first, then high ones."""
    shifts = jnp.array([0, 4], jnp.uint8)[:, None]
    return ((p[..., None, :] >> shifts) & 15).reshape(*p.shape[:-1], 2 * p.shape[-1])


def _dequant(kind: str, parts: dict[str, Any], dtype: Any) -> jax.Array:
    """Dequantized values with the parts' leading (row) dims; float32 math, like gguf."""
    f32 = jnp.float32
    if kind in ("int8", "fp8"):
        return (parts["q"].astype(f32) * parts["scale"].astype(f32)[..., None]).astype(dtype)
    d = parts["d"].astype(f32)[..., None]
    if kind == "q8_0":
        w = parts["q"].astype(f32) * d
    elif kind == "q4_0":
        w = d * (_unpack4(parts["p"]).astype(jnp.int8) - 8).astype(f32)
    elif kind == "q4_1":
        w = d * _unpack4(parts["p"]).astype(f32) + parts["m"].astype(f32)[..., None]
    else:  # q4_k: 64-value groups hold two 32-value sub-blocks (low, high nibbles)
        q = _unpack4(parts["p"])
        q = q.reshape(*q.shape[:-2], q.shape[-2] * 2, 32).astype(f32)
        sub = parts["sc"].shape[-1] // parts["d"].shape[-1]          # 8 per super-block
        scale = jnp.repeat(parts["d"].astype(f32), sub, axis=-1) * parts["sc"].astype(f32)
        dmin = jnp.repeat(parts["dmin"].astype(f32), sub, axis=-1) * parts["mn"].astype(f32)
        w = scale[..., None] * q - dmin[..., None]
    return w.reshape(*w.shape[:-2], -1).astype(dtype)


# Rows of x up to which an int8/fp8 matmul is written so that XLA:CPU fuses the convert
# of the weight into the dot (decode: reads 1 byte per weight). Above it the plain
# dot_general form ran faster in the engine (see _dot_nt).
FUSED_ROWS = 16


def _dot_nt(x: jax.Array, m: jax.Array, fuse: bool = True, **kw: Any) -> jax.Array:
    """x [..., C] . m [R, C] -> [..., R]. With fuse, written as x @ m.T on purpose:
    XLA:CPU then fuses an int8 -> float convert of m into the dot, while lax.dot_general
    contracting m's axis 1 materializes the float copy first; at 64 rows the fused form
    lost (docs/benchmarks.md, "Measurements behind code choices")."""
    if fuse:
        return jnp.matmul(x, m.T, **kw)
    return lax.dot_general(x, m, (((x.ndim - 1,), (1,)), ((), ())), **kw)


def matmul(x: jax.Array, w: QArray) -> jax.Array:
    """x [..., cols] @ M.T -> [..., rows] in x's dtype."""
    if w.kind in ("int8", "fp8"):
        scale = w.parts["scale"]
        if w.act == "int8" and w.kind == "int8":
            return _int8_dot(x, w.parts["q"], scale)
        q = w.parts["q"].astype(x.dtype)
        fuse = int(np.prod(x.shape[:-1])) <= FUSED_ROWS
        return (_dot_nt(x, q, fuse) * scale.astype(x.dtype)).astype(x.dtype)
    return _dot_nt(x, w.dequantize(x.dtype))


def _int8_dot(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """Activations quantized per row (symmetric absmax), int8 x int8 -> int32 dot: the
    fast path of TPU MXUs and GPU tensor cores."""
    xf = x.astype(jnp.float32)
    sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 127.0
    sx = jnp.where(sx > 0, sx, 1.0)
    xq = jnp.clip(jnp.round(xf / sx), -127, 127).astype(jnp.int8)
    acc = _dot_nt(xq, q, False, preferred_element_type=jnp.int32).astype(jnp.float32)
    return (acc * sx * scale.astype(jnp.float32)).astype(x.dtype)


# ---- logical axes of the parts --------------------------------------------------------

def part_axes(kind: str, name: str, row_axis: str | None, col_axis: str | None
              ) -> tuple[str | None, ...]:
    """Logical axes of one part, from the matrix's (row, col) logical axes. Block axes
    follow the column axis they subdivide; values inside a block are never split."""
    if name == "scale":
        return (row_axis,)
    if name in ("q", "p") and kind not in ("int8", "fp8"):
        return (row_axis, col_axis, None)
    return (row_axis, col_axis)


def matrix_axes(logical_axes: tuple, hf_transpose: bool) -> tuple:
    """(row, col) logical axes of the HF-oriented matrix of a parameter."""
    return tuple(reversed(logical_axes)) if hf_transpose else tuple(logical_axes)


def weight_bytes(tree: Any) -> int:
    """Bytes of every array in a weights pytree (quantized parts included), an array
    that two entries share (a tied head's panels and the lookup reading them) once."""
    leaves = {id(a): a for a in jax.tree_util.tree_leaves(tree)}
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in leaves.values())


def bytes_by_kind(tree: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_quantized):
        k = leaf.kind if is_quantized(leaf) else jnp.dtype(leaf.dtype).name
        out[k] = out.get(k, 0) + (leaf.nbytes if is_quantized(leaf) else
                                  int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize)
    return out


# ---- making quantized weights (on the host, at load) ---------------------------------

FP8_MAX = 448.0      # largest finite float8_e4m3fn


def quantize_matrix(m: Any, kind: str, dtype: Any, act: str = "none") -> QArray:
    """A float matrix [rows, cols] (HF orientation) -> int8 / fp8 per output channel."""
    a = np.asarray(m, np.float32)
    amax = np.max(np.abs(a), axis=1)
    top = 127.0 if kind == "int8" else FP8_MAX
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    if kind == "int8":
        q = np.clip(np.rint(a / scale[:, None]), -127, 127).astype(np.int8)
    elif kind == "fp8":
        q = np.asarray(jnp.asarray(a / scale[:, None]).astype(jnp.float8_e4m3fn))
    else:
        raise ValueError(f"quantize_matrix makes int8 or fp8, not {kind!r}")
    return QArray(kind, {"q": q, "scale": scale}, a.shape, jnp.dtype(dtype), act)
