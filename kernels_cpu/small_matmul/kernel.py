"""y = x @ w on XLA:CPU for a few rows of x: the C++ kernel in matmul.cc behind a jnp
signature (built and registered with the attention kernel, one library: build.py).

    small_matmul(x [M, K], w [K, N]) -> [M, N]          (w in the model's [in, out] layout)
    small_matmul(x [M, K], e [N, K], transposed=True)   -> x @ e.T  (a tied embedding)
    small_matmul_many(x [M, K], [w_1 [K, N_1], ...])    -> [x @ w_1, ...]  (1-4 weights
        sharing x, e.g. q/k/v or gate/up: one call and one thread-pool round for all)

float32 in and out; any M works, but the kernel only pays off for decode-sized M (it keeps
one row group's accumulators in registers: jaxserve/model/cpu_matmul.py picks it for M <=
MAX_ROWS). The caller checks dtypes; nothing is cast here, so no hidden copy of w is made.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.ragged_paged_attention import build


def small_matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False,
                 num_threads: int = 0, target: str | None = None) -> jax.Array:
    """num_threads: at most this many threads (0: XLA's intra-op pool); target: another
    registered build of the same handler (A/B benchmarks)."""
    assert x.ndim == 2 and w.ndim == 2, (x.shape, w.shape)
    assert x.dtype == jnp.float32 and w.dtype == jnp.float32, (x.dtype, w.dtype)
    if target is None:
        build.load()
        target = build.MATMUL_TARGET
    n = w.shape[0] if transposed else w.shape[1]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x, w, transposed=np.bool_(transposed), num_threads=np.int64(num_threads))


MAX_MANY = 4     # kMaxProblems in matmul.cc


def small_matmul_many(x: jax.Array, ws: list[jax.Array], *,
                      num_threads: int = 0) -> list[jax.Array]:
    """[x @ w for w in ws] in one kernel call (each w [K, N_i], float32)."""
    assert x.ndim == 2 and x.dtype == jnp.float32 and 1 <= len(ws) <= MAX_MANY
    assert all(w.ndim == 2 and w.dtype == jnp.float32 and w.shape[0] == x.shape[1]
               for w in ws), [(w.shape, w.dtype) for w in ws]
    build.load()
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call(build.MATMUL_MANY_TARGET, outs, vmap_method="sequential")
    return list(call(x, *ws, num_threads=np.int64(num_threads)))
