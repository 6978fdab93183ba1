"""Device check section "quant": the weight-only int8 matmul (kernels_pallas/quant_matmul)
next to XLA's dequantize-and-dot over the same int8 weights (model/quant.py matmul, what
the engine ran before) and a bf16 dot over bf16 weights, at Llama-3-8B projection shapes
and decode row counts; then the GGUF-block kernel (blocks.py) next to XLA's
dequantize-and-dot for Q4_K and Q8_0 blocks at the same shapes. Each implementation is judged
against the float32 reference (RMS error over the reference's spread <= REL_TOL) and
timed in a loop; gbps counts the weight bytes it must read (int8 and scales, or bf16),
so an implementation that widens the matrix through HBM shows up as a low figure next to
its true traffic.

    python -m jaxserve.tools.device_check --sections quant
"""
from __future__ import annotations

from typing import Any, Callable

from .device_check_run import REL_TOL, Run, guarded

FULL_SHAPES = [("gate/up 14336x4096", 14336, 4096), ("down 4096x14336", 4096, 14336),
               ("q/o 4096x4096", 4096, 4096)]
SMOKE_SHAPES = [("200x300", 200, 300)]
FULL_ROWS = (8, 64)          # the accelerators' smallest and largest decode buckets
SMOKE_ROWS = (3,)
BLOCK_KINDS = ("q4_k", "q8_0")
SMOKE_BLOCK_SHAPES = [("200x512", 200, 512)]


def _loop(fn: Callable) -> Callable:
    """jit(x, n, *weights) -> fn applied n times, x nudged by each output (no call can
    be elided; n is traced, so one compile serves every n)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def loop(x, n, *weights):
        out0 = jax.eval_shape(fn, x, *weights)

        def body(_, acc):
            xi = (x + acc[:, :1].astype(x.dtype) * 1e-3).astype(x.dtype)
            return fn(xi, *weights).astype(acc.dtype)
        return jax.lax.fori_loop(0, n, body, jnp.zeros(out0.shape, jnp.float32))
    return loop


def _seconds(run: Run, loop: Callable, x: Any, weights: tuple) -> float:
    import time

    import jax
    import numpy as np

    def call(n: int) -> float:
        t = time.perf_counter()
        jax.block_until_ready(loop(x, n, *weights))
        return time.perf_counter() - t
    run.bounded("compile", lambda: call(1))
    iters = run.iters
    times = [run.bounded(f"timed loop {i}", lambda: call(iters))
             for i in range(1 if run.smoke else 3)]
    return float(np.median(times)) / iters


def implementations(backend: str, interpret: bool, n: int, k: int, dtype: Any
                    ) -> dict[str, tuple[Callable, str]]:
    """name -> (fn(x, *weights), which weights it takes: "int8" (q, scale) or "float")."""
    from jaxserve.model.quant import QArray, matmul
    from kernels_pallas.quant_matmul.kernel import int8_matmul

    def kernel(x, q, s):
        return int8_matmul(x, q, s, backend=backend, interpret=interpret)

    def xla_int8(x, q, s):
        return matmul(x, QArray("int8", {"q": q, "scale": s}, (n, k), dtype))

    def float_dot(x, w):
        return x @ w
    return {"kernel": (kernel, "int8"), "xla_int8": (xla_int8, "int8"),
            "float_dot": (float_dot, "float")}


def quant_section(run: Run) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kernels_pallas.quant_matmul.ref import int8_matmul_ref
    backend = "tpu" if jax.default_backend() == "tpu" else "gpu"
    shapes, rows = (SMOKE_SHAPES, SMOKE_ROWS) if run.smoke else (FULL_SHAPES, FULL_ROWS)
    rng = np.random.default_rng(0)
    for label, n, k in shapes:
        q = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
        s = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
        w = (q.astype(jnp.float32) * s[:, None]).astype(run.dtype).T     # [K, N]
        weights = {"int8": ((q, s), n * k + 4 * n),
                   "float": ((w,), n * k * jnp.dtype(run.dtype).itemsize)}
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k)), run.dtype)
            ref = np.asarray(int8_matmul_ref(x.astype(jnp.float32), q, s))
            for name, (fn, kind) in implementations(backend, run.smoke, n, k,
                                                    run.dtype).items():
                args, nbytes = weights[kind]

                def one(fn: Callable = fn, args: tuple = args, nbytes: int = nbytes,
                        x: Any = x, ref: Any = ref) -> dict:
                    got = np.asarray(jax.jit(fn)(x, *args), np.float32)
                    rel = float(np.sqrt(np.mean((got - ref) ** 2)) / max(np.std(ref), 1e-30))
                    secs = _seconds(run, _loop(fn), x, args)
                    return {"ok": rel <= REL_TOL, "rel_err": rel, "us": secs * 1e6,
                            "gbps": nbytes / secs / 1e9, "mbu": run.mbu(nbytes, secs)}
                guarded(run, "quant", f"{label} m={m}", 5 + run.reserve_s, one, impl=name)
    block_rows(run)


def random_blocks(kind: str, n: int, k: int, rng: Any) -> dict[str, Any]:
    """Random parts of a valid [n, k] block matrix (scales small and positive)."""
    import jax.numpy as jnp
    from kernels_pallas.quant_matmul.blocks import part_layout
    out = {}
    for name, shape, dt in part_layout(kind, n, k):
        if dt == "float16":
            out[name] = jnp.asarray(rng.uniform(1e-3, 1e-2, shape), jnp.float16)
        elif dt == "int8":
            out[name] = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        else:
            top = 64 if name in ("sc", "mn") else 256
            out[name] = jnp.asarray(rng.integers(0, top, shape), jnp.uint8)
    return out


def block_rows(run: Run) -> None:
    """The block kernel and XLA's dequantize-and-dot on the same blocks; gbps counts the
    blocks' bytes, what each must read."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxserve.model.quant import QArray, matmul
    from kernels_pallas.quant_matmul.blocks import block_matmul
    from kernels_pallas.quant_matmul.ref import block_matmul_ref
    backend = "tpu" if jax.default_backend() == "tpu" else "gpu"
    shapes, rows = (SMOKE_BLOCK_SHAPES, SMOKE_ROWS) if run.smoke else (FULL_SHAPES, FULL_ROWS)
    rng = np.random.default_rng(1)
    for kind in BLOCK_KINDS[:1] if run.smoke else BLOCK_KINDS:     # smoke: the 4-bit body
        for label, n, k in shapes:
            parts = random_blocks(kind, n, k, rng)
            nbytes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in parts.values())

            def kernel(x, parts, kind=kind, n=n):
                return block_matmul(x, parts, kind=kind, n=n, backend=backend,
                                    interpret=run.smoke)

            def xla(x, parts, kind=kind, n=n, k=k):
                return matmul(x, QArray(kind, parts, (n, k), x.dtype))
            for m in rows:
                x = jnp.asarray(rng.standard_normal((m, k)), run.dtype)
                ref = np.asarray(block_matmul_ref(x.astype(jnp.float32), kind, parts))
                for name, fn in (("kernel", kernel), ("xla", xla)):
                    def one(fn: Callable = fn, x: Any = x, ref: Any = ref,
                            parts: Any = parts, nbytes: int = nbytes) -> dict:
                        got = np.asarray(jax.jit(fn)(x, parts), np.float32)
                        rel = float(np.sqrt(np.mean((got - ref) ** 2))
                                    / max(np.std(ref), 1e-30))
                        secs = _seconds(run, _loop(fn), x, (parts,))
                        return {"ok": rel <= REL_TOL, "rel_err": rel, "us": secs * 1e6,
                                "gbps": nbytes / secs / 1e9, "mbu": run.mbu(nbytes, secs)}
                    guarded(run, "quant", f"{kind} {label} m={m}", 5 + run.reserve_s, one,
                            impl=name)
