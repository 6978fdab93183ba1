"""What every section of the device check shares: the run (deadline, results written as
they come), the guarded call of one measurement, the deadline inside long steps, timing
loops, and the workloads."""
from __future__ import annotations

import json
import threading
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
# (name, batch, context); context = KV length each decode query attends to. The order is
# the order of value per second of lease: the headline batch, then the long contexts
# (8x8k and 1x8k share one compile: 1x8k runs padded to 8 rows), the largest batch last.
FULL_DECODE = [("64x2k", 64, 2048), ("8x8k", 8, 8192), ("1x8k", 1, 8192),
               ("256x2k", 256, 2048)]
SMOKE_DECODE = [("4x64", 4, 64), ("1x64", 1, 64)]
# kernels: workload -> the earlier one whose shapes (rows, pages, pool) it is padded to,
# sharing its compiled loops
SHARES_COMPILE = {"1x8k": "8x8k", "1x64": "4x64"}
# a kernel passes when its RMS error is at most this fraction of the reference output's
# own standard deviation (and no KV page went missing: device_check_attention.judge)
REL_TOL = 1e-2


class Deadline(Exception):
    """A step that cannot finish before the run's deadline (recorded as skipped)."""


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
    kernels: tuple[str, ...] | None = None   # kernel implementations to run (None: default)
    extra_kernels: dict[str, str] = field(default_factory=dict)   # name -> "module:function"
    t0: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)
    loops: dict[Any, Any] = field(default_factory=dict)   # compiled timing loops, shared
    abandoned: int = 0            # steps left running in a thread past the deadline

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def bounded(self, what: str, fn: Callable[[], Any], reserve_s: float | None = None
                ) -> Any:
        """fn() in a thread, waited for until `reserve_s` (default: the time kept for
        later sections) before the deadline: a compile or timing loop that would run past
        it is abandoned (Deadline; the thread keeps the device until the process exits,
        which the command then does promptly)."""
        wait = self.left() - (self.reserve_s if reserve_s is None else reserve_s)
        if wait <= 0:
            raise Deadline(f"{what}: {self.left():.0f} s left")
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e
        t = threading.Thread(target=target, name=f"device-check {what}", daemon=True)
        t.start()
        t.join(wait)
        if t.is_alive():
            self.abandoned += 1
            raise Deadline(f"{what}: not done with {max(self.left(), 0):.0f} s left")
        if "error" in box:
            raise box["error"]
        return box.get("value")

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
        run.record(section, {"name": name, **labels, "ok": False, "skipped": True,
                             "error": f"skipped: {run.left():.0f} s of budget left, "
                                      f"needs ~{need_s:.0f} s"})
        return
    try:
        row = fn()
    except Deadline as e:
        row = {"ok": False, "skipped": True, "error": f"skipped: {e}"}
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


def time_loop(loop: Callable, q: Any, rest: tuple, iters: int, reps: int = 3,
              run: Run | None = None) -> float:
    """Seconds per call: median of `reps` runs of loop(q, iters, *rest), over iters. With
    a run, every call is bounded by its deadline and iters shrink to what fits in a
    quarter of the time left (one call is timed first)."""
    import jax
    import numpy as np

    def call(n: int) -> float:
        t = time.perf_counter()
        jax.block_until_ready(loop(q, n, *rest))
        return time.perf_counter() - t
    if run is None:
        call(iters)                                      # warm
        return float(np.median([call(iters) for _ in range(reps)])) / iters
    one = run.bounded("first timed call", lambda: call(1))
    fits = int(max(run.left() - run.reserve_s, 0) / 4 / max(reps + 1, 1) / max(one, 1e-6))
    iters = max(1, min(iters, fits))
    run.bounded("warm loop", lambda: call(iters))
    times = [run.bounded(f"timed loop {i}", lambda: call(iters)) for i in range(reps)]
    return float(np.median(times)) / iters


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


TABLES = {
    "copy": ["name", "gbps", "peak_gbps", "of_peak", "us"],
    "kernels": ["name", "impl", "us", "gbps", "mbu", "vs_first", "rel_err", "max_err",
                "ref_std", "block_drop", "ok", "kernel"],
    "quant": ["name", "impl", "us", "gbps", "mbu", "rel_err", "ok"],
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
