"""Output-processing time per engine step at 64 sequences, by output_kind.

    .venv/bin/python scripts/bench_output_kind.py [--steps 1024] [--seqs 64] [--logprobs 5]

Feeds synthetic engine outputs (one token per sequence per step) through the
OutputProcessor, and then what the server does with each RequestOutput (its
ChoiceTracker), so the number is the host work a step costs besides the model. Timed
in CPU time of this thread (time.thread_time), which other processes on a busy machine
distort less than wall time. No device work; the tiny word-level tokenizer of the
tests keeps detokenization cheap, so the differences between kinds (building
cumulative outputs vs deltas) stand out. CUMULATIVE is timed with the server's
ChoiceTracker too, which since DELTA expects new content only: a cost figure there,
not a correct stream ('legacy' on the older tree gives the pre-DELTA server path).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT))

from engine_utils import tiny_tokenizer  # noqa: E402

from jaxserve.core.engine_core import EngineCoreOutput  # noqa: E402
from jaxserve.frontend.output_processor import OutputProcessor  # noqa: E402
from jaxserve.request import FinishReason, Logprob  # noqa: E402
from jaxserve.sampling.params import SamplingParams  # noqa: E402
from jaxserve.server.formatting import ChoiceTracker  # noqa: E402


def run(kind: str | None, steps: int, seqs: int, logprobs: int | None) -> dict[str, float]:
    tok = tiny_tokenizer(128)
    proc = OutputProcessor(tok)
    extra: dict = {}
    if kind is not None:
        from jaxserve.sampling.params import RequestOutputKind
        extra["output_kind"] = RequestOutputKind[kind]
    params = SamplingParams(max_tokens=steps, temperature=0, logprobs=logprobs, **extra)
    for i in range(seqs):
        proc.add_request(str(i), None, [5, 6, 7], {f"{i}-0": params})
    trackers = [ChoiceTracker(0, 1) for _ in range(seqs)]
    times: list[float] = []
    for s in range(steps):
        last = s == steps - 1
        outs = [EngineCoreOutput(
            f"{i}-0", [3 + (s * 7 + i) % 120],
            FinishReason.LENGTH if last else None,
            logprobs=None if logprobs is None else
            [{t: Logprob(-0.1 * t, t) for t in range(logprobs)}]) for i in range(seqs)]
        t0 = time.thread_time()
        results, _ = proc.process(outs)
        for r in results:
            trackers[int(r.request_id)].deltas(r)
        times.append(time.thread_time() - t0)
    tail = times[-max(1, steps // 8):]
    return {"median_ms": 1e3 * statistics.median(times),
            "last_eighth_ms": 1e3 * statistics.median(tail), "total_s": sum(times)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--kinds", default="CUMULATIVE,DELTA,FINAL_ONLY",
                   help="comma-separated; 'legacy' runs without output_kind (older code)")
    a = p.parse_args()
    for kind in a.kinds.split(","):
        r = run(None if kind == "legacy" else kind, a.steps, a.seqs, a.logprobs)
        print(f"{kind:>11}: {a.seqs} seqs x {a.steps} steps, logprobs={a.logprobs}: "
              f"{r['median_ms']:.3f} ms/step median, {r['last_eighth_ms']:.3f} ms over the "
              f"last eighth, {r['total_s']:.2f} s CPU in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
