"""How the model multiplies by a weight. Every projection, the MoE router and the head
go through one implementation object, chosen outside the model and carried in
ModelConfig.linear (static under jit, like the rest of the config): the model's layers
never ask which hardware path is on, and a weight representation (model/quant.py's
QArray, model/cpu/matmul.py's PackedWeight) is met only by an implementation that reads
it.

    Linear         XLA's dot (float [in, out] weights, QArrays dequantized in the step)
    KernelLinear   model/cpu/matmul.py: the C++ small-M kernel and its packed weights
                   (float32 panels, or QArrays as quantized panels)
    QuantKernelLinear  TPU / GPU: weight-only QArrays (int8 per channel, GGUF blocks) at
                   decode row counts through the Pallas kernels (kernels_pallas/
                   quant_matmul; per device under a sharding plan), so the dequantized
                   matrix is never an HBM buffer; everything else as Linear
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import numpy as np

from jaxserve.model.quant import QArray, matmul


@dataclass(frozen=True)
class Linear:
    """XLA's dot. Instances compare equal by class, so a config holding one hashes and
    compares like the choice it records (one jit cache entry per implementation)."""

    # whether the engine runs its C++ CPU kernels (weights packed for this implementation,
    # the CPU decode stack and greedy head open to it)
    cpu_kernels: ClassVar[bool] = False

    def __call__(self, x: jax.Array, w: Any) -> jax.Array:
        """x [..., in] times a projection: a float [in, out] array (x @ w), or a QArray
        in HF orientation [out, in] (dequantized inside the step)."""
        if isinstance(w, QArray):
            return matmul(x, w)
        return x @ w

    def many(self, x: jax.Array, ws: list[Any]) -> list[jax.Array]:
        """[self(x, w) for w in ws]: weights sharing their input (q/k/v, gate/up), which an
        implementation may multiply in one call."""
        return [self(x, w) for w in ws]

    def tied(self, x: jax.Array, embed: Any) -> jax.Array:
        """x [R, D] against a tied embedding [V, D] -> [R, V]."""
        if isinstance(embed, QArray):
            return matmul(x, embed)
        return x @ embed.T

    def head(self, x: jax.Array, w: Any) -> jax.Array:
        """x [R, D] against an output head held as a projection (an untied lm_head, or a
        tied one the implementation packed) -> [R, V]: self(x, w) unless the
        implementation computes logits differently from the layers' projections."""
        return self(x, w)


XLA_LINEAR = Linear()


# Rows of x up to which QuantKernelLinear runs the Pallas kernel: the decode buckets
# (8 to 64 tokens on TPU / GPU). At 64 bf16 rows an int8 weight's matmul does 128 flops
# per weight byte, below the ~240 (TPU v5e) and ~300 (H100) flops per HBM byte where the
# chips stop being bandwidth-bound; larger (prefill) steps keep XLA's dot.
KERNEL_ROWS = 64
# the QArray kinds the kernels read (fp8 and int8-activation weights keep XLA's dot)
KERNEL_KINDS = ("int8", "q8_0", "q4_0", "q4_1", "q4_k")
ACCEL_PLATFORMS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}


@dataclass(frozen=True)
class QuantKernelLinear(Linear):
    """Linear, except that a weight-only QArray (int8 per output channel, or GGUF blocks:
    Q8_0, Q4_0, Q4_1, Q4_K; activations not quantized) multiplied by at most `max_rows`
    rows goes through the Pallas kernel for `backend` ("tpu": Mosaic, "gpu": Triton).

    mesh: the step's sharding plan mesh, if any. A custom call has no SPMD partitioning,
    so the kernel then runs per device under shard_map, by the weight's `split` (set
    where the plan placed it): rows split (q / k / v, gate / up: column-parallel) gives
    each device its output columns; columns split (o, down: row-parallel) multiplies
    each device's slice of x and sums the partial products over the split axis. A weight
    split both ways, or not placed by the plan, keeps XLA's dot."""

    backend: str = "tpu"
    max_rows: int = KERNEL_ROWS
    interpret: bool = False         # Pallas interpret mode (tests on a CPU host)
    mesh: Any = None

    def takes(self, x: jax.Array, w: Any) -> bool:
        if not (isinstance(w, QArray) and w.kind in KERNEL_KINDS and w.act == "none"
                and int(np.prod(x.shape[:-1])) <= self.max_rows):
            return False
        if self.mesh is None:
            return True
        if w.split is None or None not in w.split:
            return False
        cols = w.split[1]
        if cols is None or w.kind == "int8":
            return True
        # a device's slice of K must hold whole blocks of every part (a scale axis that
        # does not divide is replicated by the plan, and the kernel would see all of it)
        names = cols if isinstance(cols, tuple) else (cols,)
        ways = int(np.prod([self.mesh.shape[a] for a in names]))
        return all(p.shape[1] % ways == 0 for p in w.parts.values())

    def __call__(self, x: jax.Array, w: Any) -> jax.Array:
        if self.takes(x, w):
            return self._kernel(x, w)
        return super().__call__(x, w)

    def tied(self, x: jax.Array, embed: Any) -> jax.Array:
        if self.takes(x, embed):
            return self._kernel(x, embed)
        return super().tied(x, embed)

    def _kernel(self, x: jax.Array, w: QArray) -> jax.Array:
        from kernels_pallas.quant_matmul.blocks import block_matmul
        from kernels_pallas.quant_matmul.kernel import int8_matmul
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])

        def local(x2: jax.Array, parts: dict[str, jax.Array]) -> jax.Array:
            if w.kind == "int8":
                return int8_matmul(x2, parts["q"], parts["scale"], backend=self.backend,
                                   interpret=self.interpret)
            n = next(iter(parts.values())).shape[0]          # this device's rows
            return block_matmul(x2, parts, kind=w.kind, n=n, backend=self.backend,
                                interpret=self.interpret)

        if self.mesh is None:
            out = local(x2, w.parts)
        else:
            from jax.sharding import PartitionSpec as P
            rows, cols = w.split or (None, None)

            def per_device(x2: jax.Array, parts: dict[str, jax.Array]) -> jax.Array:
                part = local(x2, parts)
                return part if cols is None else jax.lax.psum(part, cols)
            # each part splits like the matrix: rows, then its column (block) axis;
            # values inside a block are never split (model/quant.py part_axes)
            specs = {n: P(rows, *([cols] if p.ndim > 1 else []),
                          *([None] * (p.ndim - 2)))
                     for n, p in w.parts.items()}
            out = jax.shard_map(per_device, mesh=self.mesh,
                                in_specs=(P(None, cols), specs),
                                out_specs=P(None, rows), check_vma=False)(x2, w.parts)
        return out.reshape(*lead, w.shape[0])


def for_platform(platform: str, *, sharded: bool, mesh: Any = None) -> Linear:
    """The implementation the engine uses off the CPU: on TPU / GPU the quantized kernels
    (only KERNEL_KINDS QArrays meet them; a sharded step passes its plan's mesh), else XLA's dot."""
    backend = ACCEL_PLATFORMS.get(platform)
    if backend is None or (sharded and mesh is None):
        return XLA_LINEAR
    return QuantKernelLinear(backend, mesh=mesh if sharded else None)
