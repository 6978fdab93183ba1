"""y = x @ w on XLA:CPU for a few rows of x: the C++ kernel in matmul.cc behind a jnp
signature (built and registered with the attention kernel, one library: build.py).

    small_matmul(x [M, K], w [K, N]) -> [M, N]          (w in the model's [in, out] layout)
    small_matmul(x [M, K], e [N, K], transposed=True)   -> x @ e.T  (a tied embedding)
    small_matmul_many(x [M, K], [w_1 [K, N_1], ...])    -> [x @ w_1, ...]  (1-4 weights
        sharing x, e.g. q/k/v or gate/up: one call and one thread-pool round for all)
    pack(w [K, N]) -> [N / 32, K, 32]                   (32-column panels, each contiguous;
                                                         pack_fast: the same in C++)
    small_matmul_many(x, [pack(w_1), ...], packed=True) -> [x @ w_1, ...]  (any M)

float32 in and out; any M works. In the [K, N] and [N, K] layouts the kernel only pays
off for decode-sized M (jaxserve/model/cpu/matmul.py picks it for M <= MAX_ROWS); packed
weights stream contiguously and keep up with XLA's dot at every row count (matmul.cc).
The caller checks dtypes; nothing is cast here, so no hidden copy of w is made.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.ragged_paged_attention import build

PANEL = 32       # kPanel in matmul.cc: columns per packed panel


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


def pack(w: jax.Array) -> jax.Array:
    """w [K, N] (N a multiple of PANEL) -> [N / PANEL, K, PANEL]: panel p holds columns
    p*32 .. p*32+31 of every row, contiguous."""
    K, N = w.shape
    assert N % PANEL == 0, w.shape
    return jnp.transpose(w.reshape(K, N // PANEL, PANEL), (1, 0, 2))


def unpack(wp: jax.Array) -> jax.Array:
    """The inverse of pack: [P, K, 32] -> [K, P * 32]."""
    P, K, C = wp.shape
    return jnp.transpose(wp, (1, 0, 2)).reshape(K, P * C)


def pack_fast(w: jax.Array, *, from_rows: bool = False) -> jax.Array:
    """pack(w) (from_rows: pack(w.T), w a tied embedding [N, K]) by the C++ library: a
    plain copy over XLA's pool, ~5x faster than XLA's transpose (engine start)."""
    assert w.ndim == 2 and w.dtype == jnp.float32, (w.shape, w.dtype)
    N, K = w.shape if from_rows else w.shape[::-1]
    assert N % PANEL == 0, w.shape
    build.load()
    call = jax.ffi.ffi_call(build.MATMUL_PACK_TARGET,
                            jax.ShapeDtypeStruct((N // PANEL, K, PANEL), jnp.float32))
    return call(w, from_rows=np.bool_(from_rows))


def small_matmul_many(x: jax.Array, ws: list[jax.Array], *, packed: bool = False,
                      num_threads: int = 0) -> list[jax.Array]:
    """[x @ w for w in ws] in one kernel call (each w [K, N_i], or with packed=True
    pack(w) [N_i / 32, K, 32]; float32)."""
    assert x.ndim == 2 and x.dtype == jnp.float32 and 1 <= len(ws) <= MAX_MANY
    K = x.shape[1]
    if packed:
        assert all(w.ndim == 3 and w.dtype == jnp.float32 and w.shape[1:] == (K, PANEL)
                   for w in ws), [(w.shape, w.dtype) for w in ws]
        widths = [w.shape[0] * PANEL for w in ws]
    else:
        assert all(w.ndim == 2 and w.dtype == jnp.float32 and w.shape[0] == K
                   for w in ws), [(w.shape, w.dtype) for w in ws]
        widths = [w.shape[1] for w in ws]
    build.load()
    outs = [jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32) for n in widths]
    call = jax.ffi.ffi_call(build.MATMUL_MANY_TARGET, outs, vmap_method="sequential")
    return list(call(x, *ws, packed=np.bool_(packed), num_threads=np.int64(num_threads)))
