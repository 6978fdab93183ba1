"""When the model's matmuls run the C++ small-M kernel (kernels_cpu/small_matmul) instead
of XLA's dot.

Two decisions, one per time:

- engine start (`enabled`): `--cpu-matmul-kernel auto` turns it on for the CPU platform,
  unless the step is split over several devices (the caller says: the custom call has
  no partitioning rule, under such a plan XLA would gather its operands onto every
  device; XLA's dot keeps the plan's layout; a one-device plan, a data-parallel replica,
  keeps it), for float32 weights, and a kernel library that builds (else the one warning
  of the kernel build and XLA's dot). The engine records the choice as the model's
  linear implementation, ModelConfig.linear = KERNEL_LINEAR (KernelLinear, below).
- weights (`pack_weights`, by the runner when the kernel is on): each dense layer's
  float32 projections (q, k, v, o, gate, up, down) are stored packed, [N / 32, K, 32]
  (PackedWeight): the kernel reads a packed panel front to back, where the [K, N]
  layout's 128-256 byte pieces per row at a stride defeat the prefetchers (docs/
  benchmarks.md, "CPU kernels"). Packed weights take the
  kernel at every row count, prefill included (it keeps up with XLA's dot to 512 rows;
  XLA's dot on the packed layout would relayout them first). No second copy is kept.
  Quantized projections (QArrays: int8 per channel, GGUF Q8_0/Q4_0/Q4_1/Q4_K) become
  QPackedWeight, the quantized panels of kernels_cpu/small_matmul/quant.py that the
  kernel dequantizes in registers; a tied quantized embedding becomes the head's panels,
  which the token lookup reads too (PanelEmbedding): the blocks are held once.
- trace time (`fits`): for the weights left unpacked (the tied head), when the static
  row count is at most MAX_ROWS (the token bucket, static in the jitted step; larger
  buckets keep XLA's dot) and both operands are float32 arrays.

Why: at a few rows a matmul reads every weight once and does 2 M flops per weight, so
the memory bandwidth bounds it; XLA:CPU's dot fell short of that at 1 row (the tied head
far below it), while at 8 rows it beat this kernel on unpacked weights (docs/benchmarks.md,
"CPU kernels").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.linear import Linear
from jaxserve.model.quant import QArray

# The kernel handles any row count; on unpacked weights it beats XLA's dot up to 4 rows
# and ties at 8 (docs/benchmarks.md, "Measurements behind code choices").
MAX_ROWS = 4
SETTINGS = ("auto", "off")
log = logging.getLogger("jaxserve")


def enabled(setting: str, *, sharded: bool, dtype: Any) -> bool:
    """Whether an engine with these settings runs the kernel (see the module doc);
    sharded: its step is split over several devices."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_matmul_kernel must be one of {SETTINGS}, not {setting!r}")
    if setting == "off" or sharded or jax.default_backend() != "cpu":
        return False
    if jnp.dtype(dtype) != jnp.float32:
        return False
    from kernels_cpu.ragged_paged_attention import build
    return build.available()        # logs the missing piece once per process


def fits(x: Any, w: Any) -> bool:
    """Trace-time check: x [M, K] with static M <= MAX_ROWS, w a 2-D array, both f32."""
    return (isinstance(w, jax.Array) and x.ndim == 2 and w.ndim == 2
            and x.shape[0] <= MAX_ROWS and x.dtype == jnp.float32
            and w.dtype == jnp.float32)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] (the [in, out] layout of the model's projections)."""
    from kernels_cpu.small_matmul.kernel import small_matmul
    return small_matmul(x, w)


def matmul_t(x: jax.Array, e: jax.Array) -> jax.Array:
    """x [M, D] @ e[V, D].T (a tied embedding, rows contiguous)."""
    from kernels_cpu.small_matmul.kernel import small_matmul
    return small_matmul(x, e, transposed=True)


@struct.dataclass(eq=False, repr=False)   # identity eq/hash; never prints its array
class PackedWeight:
    """A [K, N] float32 projection stored as 32-column panels (see
    kernels_cpu/small_matmul/kernel.py: pack). One leaf, so jit, device placement and
    the step's argument lists treat it like the array it replaces. A flax struct
    dataclass, which jax flattens in C++ (register_dataclass): a Python tree_flatten would add
    per-call host time for each of the model's packed weights."""
    panels: Any     # [N / 32, K, 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [K, N] shape."""
        P, K, C = self.panels.shape
        return (K, P * C)

    @property
    def dtype(self) -> Any:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def unpacked(self) -> np.ndarray:
        """The [K, N] matrix again, on the host (export, checks)."""
        from kernels_cpu.small_matmul.kernel import unpack
        return np.asarray(unpack(self.panels))


@struct.dataclass(eq=False, repr=False)
class QPackedWeight:
    """A quantized projection (a QArray: int8 per channel or GGUF blocks) as the panels of
    kernels_cpu/small_matmul/quant.py: values, a scale per column and block of rows, an
    offset or an empty array. Logically [K, N] like PackedWeight (x @ w)."""
    q: Any          # [N / 32, K, 32] int8 or [N / 32, K / 2, 32] uint8 (4-bit pairs)
    scale: Any      # [N / 32, K / B, 32] float16 or float32
    offset: Any     # like scale, or [0]

    @property
    def shape(self) -> tuple[int, int]:
        P, R, C = self.q.shape
        return (R * (2 if self.q.dtype == jnp.uint8 else 1), P * C)

    @property
    def dtype(self) -> Any:
        return jnp.float32

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.offset.nbytes

    def unpacked(self) -> np.ndarray:
        """The dequantized [K, N] matrix, on the host (export, checks)."""
        from kernels_cpu.small_matmul.quant import dequantize_panels
        return dequantize_panels(self.q, self.scale, self.offset)


@struct.dataclass(eq=False, repr=False)
class PanelEmbedding:
    """A tied quantized embedding [V, D] read from the head's panels (the same buffers as
    "head_packed"): token ids index the panels' columns, so the file's blocks are held
    once for both the token lookup and the head."""
    head: QPackedWeight      # logically [D, V]

    @property
    def shape(self) -> tuple[int, int]:
        D, V = self.head.shape
        return (V, D)

    @property
    def dtype(self) -> Any:
        return jnp.float32

    @property
    def ndim(self) -> int:
        return 2

    def __getitem__(self, ids: Any) -> jax.Array:
        """Rows (token ids [T]) dequantized: [T, D] float32."""
        from kernels_cpu.small_matmul.quant import PANEL
        h = self.head
        p, c = ids // PANEL, ids % PANEL
        q = h.q[p, :, c]                                     # [T, D] or [T, D / 2]
        if h.q.dtype == jnp.uint8:                           # rows 2j, 2j + 1 of byte j
            q = jnp.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)
        D = q.shape[-1]
        block = D // h.scale.shape[1]
        w = q.astype(jnp.float32) * jnp.repeat(h.scale[p, :, c].astype(jnp.float32), block,
                                               axis=-1)
        if h.offset.size:
            w = w + jnp.repeat(h.offset[p, :, c].astype(jnp.float32), block, axis=-1)
        return w

    def unpacked(self) -> np.ndarray:
        """The dequantized [V, D] matrix, on the host (export, checks)."""
        return np.ascontiguousarray(self.head.unpacked().T)


def pack_quantized(w: Any) -> QPackedWeight | None:
    """A QArray the kernel reads (weights only: not int8 activations) as QPackedWeight."""
    from kernels_cpu.small_matmul.quant import pack_quant, packable as kernel_packable
    if not isinstance(w, QArray) or w.act != "none" or not kernel_packable(w.kind, w.shape):
        return None
    return QPackedWeight(*(jnp.asarray(a) for a in pack_quant(w.kind, w.parts, w.shape)))


PACKED_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def packable(w: Any) -> bool:
    from kernels_cpu.small_matmul.kernel import PANEL
    return (isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.float32
            and w.shape[1] % PANEL == 0 and w.shape[0] > 0)


# A tied head gets a packed copy of the embedding (transposed: [D, V] as panels) up to
# this size; the embedding itself stays for the token lookup.
TIED_HEAD_COPY_MAX_BYTES = 1 << 30


def _pack_one(w: Any) -> Any:
    """w as PackedWeight / QPackedWeight where the kernel reads it, else w."""
    from kernels_cpu.small_matmul.kernel import pack_fast
    if packable(w):
        return PackedWeight(pack_fast(w))
    got = pack_quantized(w)
    return w if got is None else got


def pack_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A copy of the weights tree with every layer's packable projection a PackedWeight
    (float32) or QPackedWeight (a QArray the quantized kernel reads), and the head
    packed: an untied lm_head in place, a tied one as "head_packed", a packed copy of
    embed.T (float32: at most TIED_HEAD_COPY_MAX_BYTES; quantized: the same blocks as
    panels). The caller's dicts are not changed; the unpacked arrays are freed once the
    caller drops them."""
    from kernels_cpu.small_matmul.kernel import pack_fast
    layers = []
    for layer in weights["layers"]:
        new = dict(layer)
        for key in PACKED_KEYS:
            if key in new:
                new[key] = _pack_one(new[key])
        layers.append(new)
    out = {**weights, "layers": layers}
    if "lm_head" in out:
        out["lm_head"] = _pack_one(out["lm_head"])
    elif (head := pack_quantized(out["embed"])) is not None:
        # one copy of the blocks: the head's panels, the token lookup reading them too
        out["head_packed"], out["embed"] = head, PanelEmbedding(head)
        log.info("tied head and embedding: the embedding's blocks as quantized panels for "
                 "the CPU kernel (%d MB, one copy)", head.nbytes >> 20)
    else:
        embed = out["embed"]
        if (isinstance(embed, jax.Array) and embed.ndim == 2
                and embed.nbytes <= TIED_HEAD_COPY_MAX_BYTES and packable(embed.T)):
            out["head_packed"] = PackedWeight(pack_fast(embed, from_rows=True))
            log.info("tied head: a packed copy of the embedding for the CPU kernel (%d MB)",
                     embed.nbytes >> 20)
    return out


def packed_matmul_many(x: jax.Array, ws: list[PackedWeight]) -> list[jax.Array]:
    """[x @ w for w in ws], x [T, K] float32, 1-4 packed weights, any T."""
    from kernels_cpu.small_matmul.kernel import small_matmul_many
    return small_matmul_many(x, [w.panels for w in ws], packed=True)


def matmul_many(x: jax.Array, ws: list[jax.Array]) -> list[jax.Array]:
    """[x @ w for w in ws] in one kernel call (weights sharing x: q/k/v, gate/up; one
    thread-pool round instead of one per matmul, ~20-35 us each on 2 cores)."""
    from kernels_cpu.small_matmul.kernel import small_matmul_many
    return small_matmul_many(x, ws)


def quant_matmul_many(x: jax.Array, ws: list[QPackedWeight], *, int8_acts: bool = False,
                      narrow_acts: bool = False) -> list[jax.Array]:
    """[x @ w for w in ws], x [T, K] float32, 1-4 quantized packed weights, any T
    (int8_acts, narrow_acts: KernelLinear's; kernels_cpu/small_matmul/quant.py)."""
    from kernels_cpu.small_matmul.quant import quant_matmul_many as kernel
    return kernel(x, [(w.q, w.scale, w.offset) for w in ws], int8_acts=int8_acts,
                  narrow_acts=narrow_acts)


def _packed(x: jax.Array, ws: list[Any], int8_acts: bool = False,
            narrow_acts: bool = False) -> list[jax.Array]:
    """x [..., K] against packed weights (all PackedWeight or all QPackedWeight), x cast
    to float32 and the results back."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    ys = (quant_matmul_many(x2, ws, int8_acts=int8_acts, narrow_acts=narrow_acts)
          if isinstance(ws[0], QPackedWeight) else packed_matmul_many(x2, ws))
    return [y.reshape(*lead, y.shape[-1]).astype(x.dtype) for y in ys]


@dataclass(frozen=True)
class KernelLinear(Linear):
    """The model's linear on this kernel: packed weights (pack_weights) at every row
    count, unpacked float32 ones (the tied head) where `fits`; anything else (QArrays,
    larger buckets on unpacked weights) on XLA's dot. int8_activations
    (--cpu-int8-activations; kernels_cpu/small_matmul/quant.cc): 4-bit panels at up to 8
    rows, and 8-bit panels past 8 rows on AVX512-VNNI CPUs, multiply quantized inputs in
    integers; the 8-bit panels' inputs in 16 bits, except in `many`."""

    cpu_kernels: ClassVar[bool] = True
    int8_activations: bool = False

    def __call__(self, x: jax.Array, w: Any) -> jax.Array:
        if isinstance(w, (PackedWeight, QPackedWeight)):
            return _packed(x, [w], self.int8_activations)[0]
        if fits(x, w):
            return matmul(x, w)
        return super().__call__(x, w)

    def many(self, x: jax.Array, ws: list[Any]) -> list[jax.Array]:
        # one kernel call for all of them: one thread-pool round instead of one per weight
        if len(ws) <= 4 and (all(isinstance(w, PackedWeight) for w in ws)
                             or all(isinstance(w, QPackedWeight) for w in ws)):
            # the model's grouped projections (q/k/v, gate/up) read a norm's output, which
            # 8-bit panels may take in 8 bits; o and down read attention outputs and SiLU
            # products, whose outliers moved greedy tokens past the quality bars in 8 bits
            # (docs/kernels.md): they get 16
            return _packed(x, ws, self.int8_activations, narrow_acts=self.int8_activations)
        if len(ws) > 1 and all(fits(x, w) for w in ws):
            return matmul_many(x, ws)
        return [self(x, w) for w in ws]

    def tied(self, x: jax.Array, embed: Any) -> jax.Array:
        if fits(x, embed):
            return matmul_t(x, embed)
        return super().tied(x, embed)

    def head(self, x: jax.Array, w: Any) -> jax.Array:
        # the logits from float inputs: the head runs on the sampled rows only, so the
        # option would gain little there, and its quality rows were measured this way
        # (docs/benchmarks.md, "Quantization")
        if isinstance(w, (PackedWeight, QPackedWeight)):
            return _packed(x, [w])[0]
        return self(x, w)


KERNEL_LINEAR = KernelLinear()
KERNEL_LINEAR_INT8_ACTS = KernelLinear(int8_activations=True)


def kernel_linear(int8_activations: bool) -> KernelLinear:
    """The engine's KernelLinear for --cpu-int8-activations."""
    return KERNEL_LINEAR_INT8_ACTS if int8_activations else KERNEL_LINEAR
