"""A/B timing of the CPU attention kernel against another build of it, side by side in one
run (the machine is shared and noisy: calls alternate between the variants, so drift hits
both; compare the ratio).

    python -m kernels_cpu.ragged_paged_attention.bench kernel --old OLD.cc [--old-flags ...]
    python -m kernels_cpu.ragged_paged_attention.bench engine --old OLD.cc [--rounds 3] \
        -- latency --batch-size 8 --input-len 32 --output-len 64    (or: -- throughput ...)

`kernel`: SmolLM2-135M's attention shapes (3 kv heads x 3 queries, head_dim 64, block 16):
decode batches of 1, 8 and 64 rows, one 256-token prefill chunk behind 128 cached tokens,
four first chunks of 128, and a 512-token offline step (two chunks after context and 30
decodes).
`engine`: `jaxserve bench latency|throughput` in fresh processes, old and new alternating; the old
variant is registered under its own FFI target before the engine starts.
OLD.cc must have the same FFI signature (the handler may differ, e.g. no thread-pool context).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np



def default_old_flags() -> str:
    """The engine's own build flags (build.compile_command: -O3, this CPU's x86-64 level or
    the portable clones, the reductions' math flags), so that old and new differ only in
    their source (-march=native alone made every case 1.0-1.7x "slower")."""
    from kernels_cpu.ragged_paged_attention import build
    cmd = build.compile_command(["g++"])[1:]
    return " ".join(f for f in cmd if not f.startswith("-I") and not f.endswith(".cc"))

OLD_TARGET = "jaxserve_rpa_bench_old"


def build_old(src: Path, flags: str) -> Path:
    import jax
    out = Path(tempfile.gettempdir()) / f"rpa_bench_old_{abs(hash((src.read_bytes(), flags)))}.so"
    if not out.exists():
        # -I this directory: an old copy's "../cpu_kernels.h" resolves to the current header
        cmd = ["g++", *flags.split(), f"-I{jax.ffi.include_dir()}",
               f"-I{Path(__file__).parent}", str(src), "-o", str(out)]
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def register_old(so: Path, *, engine: bool = False) -> str:
    """The old build's handler under OLD_TARGET. engine: also its write variant (what the
    engine's CPU backend calls on float32 caches), put in place of the new one's target
    name for this process."""
    import ctypes
    import jax
    from kernels_cpu.ragged_paged_attention import build
    lib = ctypes.cdll.LoadLibrary(str(so))
    jax.ffi.register_ffi_target(OLD_TARGET, jax.ffi.pycapsule(getattr(lib, build.SYMBOL)),
                                platform="cpu")
    if engine:
        build.load()          # the new library's other targets (matmul, stack)
        if not hasattr(lib, build.WRITE_SYMBOL):
            raise SystemExit(f"{so} has no {build.WRITE_SYMBOL}: the engine would call the "
                             "new write variant")
        jax.ffi.register_ffi_target(OLD_TARGET + "_write",
                                    jax.ffi.pycapsule(getattr(lib, build.WRITE_SYMBOL)),
                                    platform="cpu")
        build.WRITE_TARGET = OLD_TARGET + "_write"
    return OLD_TARGET


def _cases() -> dict[str, tuple]:
    from kernels_pallas.ragged_paged_attention.cases import make_case
    rng = np.random.default_rng(0)
    out = {}
    for name, q_lens, ctx in [
            ("decode b1 ctx 64", [1], [63]),          # `bench latency` 32 in / 64 out
            ("decode b8 ctx 64", [1] * 8, [63] * 8),
            ("decode b1 ctx~200", [1], [200]),
            ("decode b8 ctx~200", [1] * 8, list(rng.integers(100, 300, 8))),
            ("decode b64 ctx~200", [1] * 64, list(rng.integers(100, 300, 64))),
            ("prefill 256 after 128", [256], [128]),
            ("prefill 4 x 128 first chunks", [128] * 4, [0] * 4),
            # an offline step of the shared workload: two chunks after context + decodes
            ("mixed 200+282 chunks, 30 dec", [200, 282] + [1] * 30,
             [150, 100] + list(rng.integers(100, 300, 30)))]:
        rows = len(q_lens)
        pages = -(-max(q + c for q, c in zip(q_lens, ctx)) // 16)
        case = make_case(rng, q_lens, [int(c) for c in ctx], num_tokens=max(16, sum(q_lens)),
                         num_rows=rows, num_kv_heads=3, group=3, head_dim=64, block_size=16,
                         pages=pages, num_blocks=rows * pages + 1)
        out[name] = case.kernel_args()
    return out


def _call(target: str, args: tuple, threads: int):
    import jax
    import jax.numpy as jnp
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(args[0].shape, jnp.float32))
    fn = jax.jit(lambda *a: call(*a, scale=np.float32(0.125), sliding_window=np.int64(0),
                                 soft_cap=np.float32(0.0), num_threads=np.int64(threads)))
    return lambda: jax.block_until_ready(fn(*args))


def bench_kernel(old_target: str, new_target: str, reps: int) -> None:
    print(f"{'case':<24}{'old us':>10}{'new us':>10}{'old/new':>9}")
    for name, args in _cases().items():
        # the old kernel spawned its own threads, as many as kernel.py asked for (the CPUs
        # this process may use); the new one takes XLA's pool (0: all of it)
        fns = {"old": _call(old_target, args, len(os.sched_getaffinity(0))),
               "new": _call(new_target, args, 0)}
        np.testing.assert_allclose(np.asarray(fns["old"]()), np.asarray(fns["new"]()),
                                   atol=2e-5, rtol=2e-5)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(reps):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
        o, n = (1e6 * float(np.median(times[k])) for k in ("old", "new"))
        print(f"{name:<24}{o:>10.1f}{n:>10.1f}{o / n:>9.2f}")


ENGINE_CHILD = """
import sys, json
from pathlib import Path
so, out, argv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if so:
    from kernels_cpu.ragged_paged_attention import bench, build
    build._loaded = bench.register_old(Path(so), engine=True)
from jaxserve.cli import main
sys.exit(main(["bench", *argv, "--output-json", out]))
"""


def bench_engine(old_so: Path, rounds: int, argv: list[str]) -> None:
    res: dict[str, list[float]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for key, so in (("old", str(old_so)), ("new", "")):
                out = os.path.join(tmp, f"{key}{r}.json")
                run = subprocess.run([sys.executable, "-c", ENGINE_CHILD, so, out,
                                      json.dumps(argv)], capture_output=True, text=True)
                if run.returncode != 0:
                    sys.exit(f"{key} run failed:\n{run.stderr[-3000:]}")
                res[key].append(json.load(open(out))["output_tokens_per_s"])
                print(f"round {r} {key}: {res[key][-1]:.1f} output tok/s", flush=True)
    o, n = (float(np.median(res[k])) for k in ("old", "new"))
    print(f"median output tok/s: old {o:.1f}, new {n:.1f}, new/old {n / o:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["kernel", "engine"])
    ap.add_argument("--old", type=Path, required=True, help="kernel.cc of the old variant")
    ap.add_argument("--old-flags", default=None, help="default: the engine's build flags")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ns = ap.parse_args(argv[:cut])
    ns.rest = argv[cut + 1:]      # engine: `jaxserve bench` subcommand and flags
    old_so = build_old(ns.old, ns.old_flags or default_old_flags())
    if ns.what == "kernel":
        from kernels_cpu.ragged_paged_attention import build
        bench_kernel(register_old(old_so), build.load(), ns.reps)
    else:
        bench_engine(old_so, ns.rounds, ns.rest)


if __name__ == "__main__":
    main()
