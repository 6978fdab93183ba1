"""When the model's matmuls run the C++ small-M kernel (kernels_cpu/small_matmul) instead
of XLA's dot.

Two decisions, one per time:

- engine start (`enabled`): `--cpu-matmul-kernel auto` turns it on for the CPU platform,
  without a sharding plan over several devices (the custom call has no partitioning
  rule: under such a plan XLA would gather its operands onto every device; XLA's dot
  keeps the plan's layout; a one-device plan, a data-parallel replica, keeps it),
  float32 weights, and a kernel library that builds (else the one warning of the kernel
  build and XLA's dot). The engine records the choice in ModelConfig.cpu_matmul.
- trace time (`fits`): per matmul, when the static row count is at most MAX_ROWS (the
  token bucket, static in the jitted step; larger buckets keep XLA's dot) and both
  operands are float32 arrays.

Why: at a few rows a matmul reads every weight once and does 2 M flops per weight, so
the memory bandwidth bounds it; XLA:CPU's dot fell short of that at 1 row (the tied head
at 5-10 GB/s), while at 8 rows it beat this kernel (docs/benchmarks.md, "CPU small-M
matmul kernel").
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# The kernel handles any row count; where it beats XLA's dot is measured on a quiet
# machine (docs/benchmarks.md, "CPU small-M matmul kernel"): the 211 matmuls of the
# default model 8.4x / 1.10x / 1.22x faster at 1 / 2 / 4 rows, equal at 8 rows.
MAX_ROWS = 4
SETTINGS = ("auto", "off")


def enabled(setting: str, *, plan: Any, dtype: Any) -> bool:
    """Whether an engine with these settings runs the kernel (see the module doc)."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_matmul_kernel must be one of {SETTINGS}, not {setting!r}")
    from jaxserve.parallel.shard import spans_devices
    if setting == "off" or spans_devices(plan) or jax.default_backend() != "cpu":
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


def matmul_many(x: jax.Array, ws: list[jax.Array]) -> list[jax.Array]:
    """[x @ w for w in ws] in one kernel call (weights sharing x: q/k/v, gate/up; one
    thread-pool round instead of one per matmul, ~20-35 us each on 2 cores)."""
    from kernels_cpu.small_matmul.kernel import small_matmul_many
    return small_matmul_many(x, ws)
