"""XLA's dot vs the C++ small-M matmul (kernels_cpu/small_matmul), side by side in one
process, at the decode row counts and the default model's shapes (SmolLM2-135M: D=576,
F=1536, 3 kv heads of 64, tied head V=49152).

    python -m kernels_cpu.small_matmul.bench [--rows 1 2 4 8 16] [--rounds 2] [--json out.json]
                                       [--library OTHER.so]   # A/B another build

Per shape, one jitted program runs the matmul over `copies` different weight matrices
(together >= --mb MiB, at most 64 copies) one after the other, each call's input
depending on the previous call's output, so the weights stream from memory as they do in
a decode step (one matrix alone would sit in the 32 MB L3 after the first call). "model"
chains the whole model's matmuls: 30 layers of q, k, v, o, gate, up, down and the tied
head, 540 MB of weights; "model, grouped" the same with the kernel called with the
engine's grouping (q/k/v and gate/up in one call each) on [K, N] weights; "model,
packed" the same on packed panels, the engine's form (docs/kernels.md). Rounds alternate XLA and the
kernel; the best round is reported (ms per matmul, GB/s of weights, ratio).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.small_matmul.kernel import small_matmul

D, F, KV, V, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = {"q/o 576x576": (D, D), "k/v 576x192": (D, KV), "gate/up 576x1536": (D, F),
          "down 1536x576": (F, D), "head 576x49152 (E^T)": (D, V)}
ALT_TARGET = "jaxserve_small_matmul_bench_alt"


def xla_mm(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    return x @ w.T if transposed else x @ w


def kernel_mm(target: str | None) -> Callable[..., jax.Array]:
    return lambda x, w, transposed: small_matmul(x, w, transposed=transposed, target=target)


def chained(mm: Callable[..., jax.Array], transposed: list[bool]) -> Callable:
    """jit(xs, ws) running mm over every w in turn (xs: an input per contraction size);
    each input depends on the previous output (x + 0 * y[:, :1], not folded for floats)
    so nothing runs concurrently."""
    def run(xs, ws):
        total = jnp.float32(0)
        for w, t in zip(ws, transposed):
            y = mm(xs[w.shape[1] if t else w.shape[0]], w, t)
            total = total + y[0, 0]
            xs = {k: x + 0.0 * y[:, :1] for k, x in xs.items()}
        return total
    return jax.jit(run)


def grouped_chain(packed: bool = False) -> Callable:
    """The kernel arm of the model chain with the engine's grouping: per layer q/k/v in
    one small_matmul_many call, o, gate/up in one call, down; then the head (121 calls
    instead of 211). Same weights and dependency chain as `chained`. packed: the weights
    are packed panels (pack_model), as the engine stores them, head included."""
    from kernels_cpu.small_matmul.kernel import small_matmul_many
    def run(xs, ws):
        total = jnp.float32(0)
        groups = []
        for layer in range(LAYERS):
            q, k, v, o, g, u, d = ws[layer * 7:(layer + 1) * 7]
            groups += [[q, k, v], [o], [g, u], [d]]
        for grp in groups:
            ys = small_matmul_many(xs[grp[0].shape[1 if packed else 0]], grp, packed=packed)
            total = total + sum(y[0, 0] for y in ys)
            xs = {key: x + 0.0 * ys[0][:, :1] for key, x in xs.items()}
        if packed:
            y = small_matmul_many(xs[ws[-1].shape[1]], [ws[-1]], packed=True)[0]
        else:
            y = small_matmul(xs[ws[-1].shape[1]], ws[-1], transposed=True)
        return total + y[0, 0]
    return jax.jit(run)


def pack_model(ws: list) -> list:
    """model_weights' list packed as the engine packs it (the tied head from its rows)."""
    from kernels_cpu.small_matmul.kernel import pack_fast
    return [pack_fast(w) for w in ws[:-1]] + [pack_fast(ws[-1], from_rows=True)]


def best_seconds(fn: Callable, *args, reps: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def weights_for(shape: tuple[int, int], transposed: bool, copies: int, key) -> list:
    k, n = shape
    dims = (n, k) if transposed else (k, n)
    return [jax.random.normal(jax.random.fold_in(key, i), dims, jnp.float32) * 0.05
            for i in range(copies)]


def model_weights(key) -> tuple[list, list[bool]]:
    shapes = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]
    ws, ts = [], []
    for layer in range(LAYERS):
        for i, s in enumerate(shapes):
            ws += weights_for(s, False, 1, jax.random.fold_in(key, layer * 10 + i))
            ts.append(False)
    ws += weights_for((D, V), True, 1, jax.random.fold_in(key, 999))
    ts.append(True)
    return ws, ts


def compare(M: int, ws: list, ts: list[bool], target: str | None, rounds: int,
            reps: int, grouped: bool = False, packed: bool = False) -> dict:
    """grouped: the kernel arm is grouped_chain (the model chain only); packed: on the
    packed weights."""
    sizes = {w.shape[1] if t else w.shape[0] for w, t in zip(ws, ts)}
    x = {k: jax.random.normal(jax.random.PRNGKey(M * 7 + k), (M, k), jnp.float32)
         for k in sizes}
    fx = chained(xla_mm, ts)
    fk = grouped_chain(packed) if grouped else chained(kernel_mm(target), ts)
    wk = pack_model(ws) if packed else ws
    got_x, got_k = float(fx(x, ws)), float(fk(x, wk))      # compile + a sanity check
    assert abs(got_x - got_k) <= 1e-3 * max(1.0, abs(got_x)), (got_x, got_k)
    tx, tk = [], []
    for _ in range(rounds):
        tx.append(best_seconds(fx, x, ws, reps=reps))
        tk.append(best_seconds(fk, x, wk, reps=reps))
    nbytes = sum(w.size * 4 for w in ws)
    bx, bk = min(tx), min(tk)
    return {"rows": M, "calls": len(ws), "mb": nbytes / 2**20,
            "xla_ms": bx / len(ws) * 1e3, "kernel_ms": bk / len(ws) * 1e3,
            "xla_gbs": nbytes / bx / 1e9, "kernel_gbs": nbytes / bk / 1e9,
            "speedup": bx / bk}


def register_alt(path: str) -> str:
    from kernels_cpu.ragged_paged_attention import build
    lib = ctypes.cdll.LoadLibrary(os.path.abspath(path))
    jax.ffi.register_ffi_target(ALT_TARGET, jax.ffi.pycapsule(getattr(lib, build.MATMUL_SYMBOL)),
                                platform="cpu")
    return ALT_TARGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds per case")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per round (median)")
    ap.add_argument("--mb", type=float, default=96, help="weights per shape case, MiB")
    ap.add_argument("--no-model", action="store_true", help="skip the whole-model chain")
    ap.add_argument("--cases", nargs="+", default=list(SHAPES),
                    help=f"shape cases among {list(SHAPES)} (a prefix will do)")
    ap.add_argument("--library", help="time this build of matmul.cc instead of the cached one")
    ap.add_argument("--json", help="write the rows here")
    ns = ap.parse_args()
    target = register_alt(ns.library) if ns.library else None
    key = jax.random.PRNGKey(0)
    print(f"load average {os.getloadavg()[0]:.1f}, XLA devices {jax.devices()}")
    print(f"{'case':24s} {'M':>3s} {'calls':>5s} {'MiB':>6s} | {'XLA ms':>8s} {'GB/s':>6s} | "
          f"{'kernel ms':>9s} {'GB/s':>6s} | {'x':>5s}")
    rows = []
    cases = [(name, shape, name.startswith("head")) for name, shape in SHAPES.items()
             if any(name.startswith(c) for c in ns.cases)]
    for M in ns.rows:
        for name, shape, t in cases:
            copies = int(min(64, max(2, np.ceil(ns.mb * 2**20 / (shape[0] * shape[1] * 4)))))
            ws = weights_for(shape, t, copies, jax.random.fold_in(key, hash(name) % 1000))
            rows.append({"case": name, **compare(M, ws, [t] * copies, target, ns.rounds,
                                                 ns.reps)})
            del ws
            _print(rows[-1])
        if not ns.no_model:
            ws, ts = model_weights(key)
            rows.append({"case": "model (30 layers + head)",
                         **compare(M, ws, ts, target, ns.rounds, max(3, ns.reps // 2))})
            _print(rows[-1], per_step=True)
            if not ns.library:
                rows.append({"case": "model, q/k/v + gate/up grouped",
                             **compare(M, ws, ts, None, ns.rounds, max(3, ns.reps // 2),
                                       grouped=True)})
                _print(rows[-1], per_step=True)
                rows.append({"case": "model, packed (the engine's form)",
                             **compare(M, ws, ts, None, ns.rounds, max(3, ns.reps // 2),
                                       grouped=True, packed=True)})
                _print(rows[-1], per_step=True)
            del ws
    print(f"load average {os.getloadavg()[0]:.1f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"load_average": os.getloadavg(), "rows": rows}, f, indent=1)


def _print(r: dict, per_step: bool = False) -> None:
    xm, km = r["xla_ms"], r["kernel_ms"]
    if per_step:      # the whole chain: ms per step, not per matmul
        xm, km = xm * r["calls"], km * r["calls"]
    print(f"{r['case']:24s} {r['rows']:3d} {r['calls']:5d} {r['mb']:6.0f} | {xm:8.3f} "
          f"{r['xla_gbs']:6.1f} | {km:9.3f} {r['kernel_gbs']:6.1f} | {r['speedup']:5.2f}",
          flush=True)


if __name__ == "__main__":
    main()
