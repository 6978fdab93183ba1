"""How the model multiplies by a weight. Every projection, the MoE router and the head
go through one implementation object, chosen outside the model and carried in
ModelConfig.linear (static under jit, like the rest of the config): the model's layers
never ask which hardware path is on, and a weight representation (model/quant.py's
QArray, model/cpu/matmul.py's PackedWeight) is met only by an implementation that reads
it.

    Linear         XLA's dot (float [in, out] weights, QArrays dequantized in the step)
    KernelLinear   model/cpu/matmul.py: the C++ small-M kernel and its packed weights
                   (float32 panels, or QArrays as quantized panels)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax

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


XLA_LINEAR = Linear()
