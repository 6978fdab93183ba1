"""When the model's matmuls run the C++ small-M kernel (kernels_cpu/small_matmul) instead
of XLA's dot.

Two decisions, one per time:

- engine start (`enabled`): `--cpu-matmul-kernel auto` turns it on for the CPU platform,
  without a sharding plan over several devices (the custom call has no partitioning
  rule: under such a plan XLA would gather its operands onto every device; XLA's dot
  keeps the plan's layout; a one-device plan, a data-parallel replica, keeps it),
  float32 weights, and a kernel library that builds (else the one warning of the kernel
  build and XLA's dot). The engine records the choice in ModelConfig.cpu_matmul.
- weights (`pack_weights`, by the runner when the kernel is on): each dense layer's
  float32 projections (q, k, v, o, gate, up, down) are stored packed, [N / 32, K, 32]
  (PackedWeight): the kernel reads a packed panel front to back, at ~38 GB/s at 1 row
  and ~35 GB/s at 8 rows where the [K, N] layout streamed at ~31 and ~17 (its 128-256
  byte pieces per row at a stride defeat the prefetchers). Packed weights take the
  kernel at every row count, prefill included (it keeps up with XLA's dot to 512 rows;
  XLA's dot on the packed layout would relayout them first). No second copy is kept.
- trace time (`fits`): for the weights left unpacked (the tied head), when the static
  row count is at most MAX_ROWS (the token bucket, static in the jitted step; larger
  buckets keep XLA's dot) and both operands are float32 arrays.

Why: at a few rows a matmul reads every weight once and does 2 M flops per weight, so
the memory bandwidth bounds it; XLA:CPU's dot fell short of that at 1 row (the tied head
at 5-10 GB/s), while at 8 rows it beat this kernel (docs/benchmarks.md, "CPU small-M
matmul kernel").
"""
from __future__ import annotations

import logging
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

# The kernel handles any row count; where it beats XLA's dot is measured on a quiet
# machine (docs/benchmarks.md, "CPU small-M matmul kernel"): the 211 matmuls of the
# default model 8.4x / 1.10x / 1.22x faster at 1 / 2 / 4 rows, equal at 8 rows.
MAX_ROWS = 4
SETTINGS = ("auto", "off")
log = logging.getLogger("jaxserve")


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


@struct.dataclass(eq=False, repr=False)   # identity eq/hash; never prints its array
class PackedWeight:
    """A [K, N] float32 projection stored as 32-column panels (see
    kernels_cpu/small_matmul/kernel.py: pack). One leaf, so jit, device placement and
    the step's argument lists treat it like the array it replaces. A flax struct
    dataclass, which jax flattens in C++ (register_dataclass): a Python tree_flatten cost
    ~0.1 ms per step call for the default model's 211 packed weights."""
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


PACKED_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def packable(w: Any) -> bool:
    from kernels_cpu.small_matmul.kernel import PANEL
    return (isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.float32
            and w.shape[1] % PANEL == 0 and w.shape[0] > 0)


# A tied head gets a packed copy of the embedding (transposed: [D, V] as panels) up to
# this size; the embedding itself stays for the token lookup.
TIED_HEAD_COPY_MAX_BYTES = 1 << 30


def pack_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A copy of the weights tree with every layer's packable projection a PackedWeight,
    and the head packed: an untied lm_head in place, a tied one as "head_packed", a
    packed copy of embed.T (at most TIED_HEAD_COPY_MAX_BYTES). The caller's dicts are not
    changed; the unpacked arrays are freed once the caller drops them."""
    from kernels_cpu.small_matmul.kernel import pack_fast
    layers = []
    for layer in weights["layers"]:
        new = dict(layer)
        for key in PACKED_KEYS:
            if key in new and packable(new[key]):
                new[key] = PackedWeight(pack_fast(new[key]))
        layers.append(new)
    out = {**weights, "layers": layers}
    if "lm_head" in out:
        if packable(out["lm_head"]):
            out["lm_head"] = PackedWeight(pack_fast(out["lm_head"]))
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
