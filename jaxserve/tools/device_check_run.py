"""What every section of the device check shares: the run (deadline, results written as
they come), the guarded call of one measurement, timing loops, and the workloads."""
from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]

# Datasheet HBM bandwidth (bytes/s) by jax device_kind prefix; --peak-gbps overrides.
PEAK_BW = {"NVIDIA H200": 4.8e12, "NVIDIA H100": 3.35e12, "NVIDIA A100-SXM4-80GB": 2.04e12,
           "NVIDIA A100": 1.555e12, "NVIDIA L4": 0.3e12, "TPU v6": 1.64e12,
           "TPU v5p": 2.765e12, "TPU v5 lite": 0.819e12, "TPU v5e": 0.819e12,
           "TPU v4": 1.2e12}
FULL_HEADS = dict(num_kv_heads=8, group=4, head_dim=128, block_size=16)
SMOKE_HEADS = dict(num_kv_heads=2, group=2, head_dim=16, block_size=8)
# (name, batch, context); context = KV length each decode query attends to
FULL_DECODE = [("64x2k", 64, 2048), ("256x2k", 256, 2048), ("8x8k", 8, 8192),
               ("1x8k", 1, 8192)]
SMOKE_DECODE = [("4x40", 4, 40), ("1x64", 1, 64)]
ATOL = {"bfloat16": 3e-2, "float32": 2e-5}


@dataclass
class Run:
    """Shared state: options, the clock, and the results written after every step."""
    smoke: bool
    out: Path
    budget_s: float
    iters: int
    peak_bw: float | None
    dtype: Any
    reserve_s: float = 0.0        # kept for later sections: earlier ones skip into it
    sweep: bool = False           # kernels: also time the tiled kernel's launch parameters
    t0: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def record(self, section: str, row: dict) -> None:
        row.setdefault("t_s", round(time.monotonic() - self.t0, 1))
        self.results.setdefault(section, []).append(row)
        print(json.dumps({"section": section, **row}, default=str), flush=True)
        write_report(self)

    def mbu(self, nbytes: float, seconds: float) -> float | None:
        return None if not self.peak_bw or seconds <= 0 else nbytes / seconds / self.peak_bw


def guarded(run: Run, section: str, name: str, need_s: float, fn: Callable[[], dict],
            **labels: Any) -> None:
    """Run one measurement; record its row, its error, or that the budget ran out
    (labels, e.g. impl=..., go into the row in every case)."""
    if run.left() < need_s:
        run.record(section, {"name": name, **labels, "ok": False,
                             "error": f"skipped: {run.left():.0f} s of budget left, "
                                      f"needs ~{need_s:.0f} s"})
        return
    try:
        row = fn()
    except Exception as e:  # noqa: BLE001 - one failure must not lose the other results
        traceback.print_exc()
        row = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
    run.record(section, {"name": name, **labels, **row})


# ---- timing -----------------------------------------------------------------------------
def looped(fn: Callable) -> Callable:
    """jit(q, n, *rest) -> fn applied n times, each query nudged by the previous output
    (so no call can be elided); n is traced, so one compile serves n = 1 (the output
    fn(q, *rest) itself: q + 0 is q) and the timed n: launch overhead is paid once per
    loop, not per call."""
    import jax

    @jax.jit
    def loop(q, n, *rest):
        def body(_, acc):
            return fn((q + acc * 1e-3).astype(q.dtype), *rest).astype(acc.dtype)
        return jax.lax.fori_loop(0, n, body, jax.numpy.zeros_like(q))
    return loop


def time_loop(loop: Callable, q: Any, rest: tuple, iters: int, reps: int = 3) -> float:
    """Seconds per call: median of `reps` runs of loop(q, iters, *rest), over iters."""
    import jax
    import numpy as np
    jax.block_until_ready(loop(q, iters, *rest))          # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(loop(q, iters, *rest))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / iters


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


TABLES = {
    "copy": ["name", "gbps", "peak_gbps", "of_peak", "us"],
    "kernels": ["name", "impl", "us", "gbps", "mbu", "max_err", "err_std", "ref_std", "ok",
                "kernel"],
    "engine": ["name", "bucket", "step_ms", "mbu", "dispatch_ms", "device_ms", "host_ms",
               "first_step_s", "compile_s", "recompiles", "tok_per_s", "ok"],
}


def write_report(run: Run) -> None:
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "results.json").write_text(json.dumps(run.results, indent=1, default=str))
    meta = run.results.get("meta", [{}])[0]
    lines = [f"# device check: {meta.get('device', '?')} (jax {meta.get('jax', '?')}, "
             f"{'smoke' if run.smoke else 'full'})", ""]
    for section, cols in TABLES.items():
        rows = run.results.get(section, [])
        if not rows:
            continue
        lines += [f"## {section}", "", "| " + " | ".join(cols) + " |",
                  "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
        errors = [f"- {r['name']} {r.get('impl', '')}: {r['error']}" for r in rows
                  if r.get("error")]
        lines += [""] + errors + ([""] if errors else [])
    failed = [f"- {s} {r['name']}: {r['error']}" for s, rs in run.results.items()
              if s not in TABLES for r in rs if r.get("error")]
    if failed:
        lines += ["## set-up failures", ""] + failed + [""]
    (run.out / "results.md").write_text("\n".join(lines) + "\n")
