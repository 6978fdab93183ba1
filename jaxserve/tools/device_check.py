"""Device check: the attention kernels and the fused engine step on a real accelerator.

One run (--budget seconds, default 330; a lease of 15 minutes fits it with the start)
measures, at Llama-3-8B shapes (bf16, 32 query heads, 8 KV heads, head_dim 128,
16-token pages):

  * copy: achievable HBM bandwidth (x * 2 over 2 GiB), next to the datasheet peak;
  * kernels: decode at 64x2k, 8x8k, 1x8k, 256x2k (batch x context, in that order: 1x8k
    reuses 8x8k's compile) plus one mixed prefill/decode batch: the engine's kernel, the
    other variant, jax's own paged attention (GPU) and any --kernel side by side, each
    judged against a float64 reference (RMS error over the reference's spread <= 1e-2,
    and no KV page missing) and timed: us/call, GB/s, MBU;
  * quant: the weight-only int8 matmul kernel next to XLA's dequantize-and-dot and a
    bf16 dot at Llama-3-8B projection shapes, 8 and 64 rows (device_check_quant.py);
  * engine: the engine's fused step (EngineCore, Pallas backend, the shipped H200
    config) with random bf16 weights, decoding the same batches: first-step time
    (compile), steady step time, MBU, host dispatch vs device time, recompiles.

It cannot overrun its budget by more than a few seconds: compiles and timing loops run
under the deadline and a step that would pass it is abandoned and recorded as skipped.
Every section and workload is in its own try/except: a failure is recorded and the rest
still runs. Results go to --out (default $OUT, else ./device_check_out) as results.json
and results.md, rewritten after every row, with the console log (log.txt: stdout and
stderr, the native runtime's included). The script sets HF_HUB_OFFLINE=1 and puts the
jaxserve cache (compiles, kernels) in --cache (default /tmp/jaxserve-device-check).

    timeout 420 python -m jaxserve.tools.device_check       # accelerator, 330 s budget
    python -m jaxserve.tools.device_check --smoke           # CPU, tiny shapes (<2 min)
    ... --kernel new=kernels_pallas.ragged_paged_attention.kernel_v2:ragged_paged_attention

The sections live in device_check_attention.py, device_check_quant.py and
device_check_engine.py beside this module. The kernel section's decode and mixed workloads come from an earlier kernel-only
check; its XLA-reference column gave way to jax's paged attention.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from .device_check_run import PEAK_BW, Run, guarded

DEFAULT_CACHE = "/tmp/jaxserve-device-check"

def copy_bandwidth(run: Run) -> dict:
    """Achievable bandwidth: one read and one write of a large bf16 array."""
    import jax
    import jax.numpy as jnp
    n = (1 << 20) if run.smoke else (1 << 30)            # elements: 2 MiB / 2 GiB
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    jax.block_until_ready(f(x))
    reps = 3 if run.smoke else 20
    t = time.perf_counter()
    for _ in range(reps):
        y = f(x)
    jax.block_until_ready(y)
    secs = (time.perf_counter() - t) / reps
    nbytes = 2 * x.nbytes
    return {"ok": True, "bytes": nbytes, "us": secs * 1e6, "gbps": nbytes / secs / 1e9,
            "peak_gbps": run.peak_bw / 1e9 if run.peak_bw else None,
            "of_peak": run.mbu(nbytes, secs)}


# ---- report -------------------------------------------------------------------------------
# ---- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, interpret mode")
    p.add_argument("--out", default=os.environ.get("OUT") or "device_check_out")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run (default 330; smoke 240, a cap for a "
                        "busy CPU: it takes under 2 min on an idle one)")
    p.add_argument("--iters", type=int, default=None, help="kernel calls per timed loop")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="HBM bandwidth for MBU (default: datasheet value by device kind)")
    p.add_argument("--sections", default="copy,kernels,quant,engine")
    p.add_argument("--sweep", action="store_true", help="kernels: also time the tiled "
                   "GPU kernel with other block_kv / block_m / num_warps (64x2k, mixed)")
    p.add_argument("--layers", type=int, default=None, help="engine: decoder layers "
                   "(default 32, the Llama-3-8B count)")
    p.add_argument("--engine-steps", type=int, default=None, help="timed decode steps")
    p.add_argument("--kernels", default=None, help="kernels: comma-separated names to run "
                   "(ours, tiled, splitk, jax, --kernel names; default: ours, the variant "
                   "the engine did not pick, jax on GPU, every --kernel)")
    p.add_argument("--kernel", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                   help="kernels: one more implementation, called like "
                        "ragged_paged_attention (repeatable)")
    p.add_argument("--cache", default=DEFAULT_CACHE,
                   help="JAXSERVE_CACHE for this run (compiles, built kernels)")
    return p.parse_args(argv)


def peak_bandwidth(kind: str, override_gbps: float | None) -> float | None:
    if override_gbps:
        return override_gbps * 1e9
    for prefix, bw in sorted(PEAK_BW.items(), key=lambda kv: -len(kv[0])):
        if kind.startswith(prefix):
            return bw
    return None


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    # The engine section holds 16 GB of weights and ~70 GB of KV: let jax take most of HBM.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["JAXSERVE_CACHE"] = ns.cache
    import jax
    import jax.numpy as jnp
    from jaxserve.worker.compile_cache import enable_compilation_cache
    enable_compilation_cache(ns.cache)      # a rerun on the same machine skips compiles
    kind = jax.devices()[0].device_kind
    extra = dict(k.split("=", 1) for k in ns.kernel)
    run = Run(smoke=ns.smoke, out=Path(ns.out),
              budget_s=ns.budget or (240.0 if ns.smoke else 330.0),
              iters=ns.iters or (2 if ns.smoke else 50),
              peak_bw=peak_bandwidth(kind, ns.peak_gbps),
              dtype=jnp.float32 if ns.smoke else jnp.bfloat16, sweep=ns.sweep,
              kernels=tuple(ns.kernels.split(",")) if ns.kernels else None,
              extra_kernels=extra)
    run.record("meta", {"name": "meta", "device": kind, "backend": jax.default_backend(),
                        "jax": jax.__version__, "python": sys.version.split()[0],
                        "smoke": ns.smoke, "budget_s": run.budget_s,
                        "peak_gbps": run.peak_bw / 1e9 if run.peak_bw else None})
    sections = set(ns.sections.split(","))
    # the engine's first batch (compile included) is the headline: kernels leave it time
    run.reserve_s = (20.0 if ns.smoke else 120.0) if "engine" in sections else 0.0
    if "copy" in sections:
        guarded(run, "copy", "copy", 5, lambda: copy_bandwidth(run))
    if "kernels" in sections:
        from .device_check_attention import kernel_section
        kernel_section(run)
    if "quant" in sections:
        from .device_check_quant import quant_section
        quant_section(run)
    if "engine" in sections:
        run.reserve_s = 0.0                 # the last section: all the time left is its own
        from .device_check_engine import engine_section
        engine_section(run, layers=ns.layers, steps=ns.engine_steps)
    rows = [r for s, rs in run.results.items() if s != "meta" for r in rs]
    skipped = [r for r in rows if r.get("skipped")]
    ok = bool(rows) and all(r.get("ok") for r in rows)
    print(f"{'PASS' if ok else 'FAIL'}: {len(rows)} rows ({len(skipped)} skipped for time) "
          f"in {time.monotonic() - run.t0:.0f} s; wrote {run.out}/results.md and "
          f"results.json", flush=True)
    return 0 if ok else 1


def tee_output(path: Path) -> None:
    """From here on, everything written to stdout and stderr (Python's and the native
    runtime's) also goes to `path`, as it comes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "ab", buffering=0)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        original = os.dup(fd)
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)

        def pump(r: int = r, original: int = original) -> None:
            while chunk := os.read(r, 1 << 16):
                os.write(original, chunk)
                log.write(chunk)
        threading.Thread(target=pump, daemon=True, name=f"tee {fd}").start()
    sys.stdout.reconfigure(line_buffering=True)    # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)    # type: ignore[union-attr]


def cli(argv: list[str] | None = None) -> int:
    """The command: the log kept under --out, then main(); exits at once afterwards (a
    step abandoned at the deadline may still hold a thread)."""
    ns = parse_args(argv)
    tee_output(Path(ns.out) / "log.txt")
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.2)                 # the tee threads drain the pipes
    os._exit(code)


if __name__ == "__main__":
    cli()
