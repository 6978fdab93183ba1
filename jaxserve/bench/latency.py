"""`jaxserve bench latency`: end-to-end latency of one fixed batch (like `vllm bench latency`).

A batch of `batch_size` prompts of `input_len` random ids, each generating exactly
`output_len` tokens (greedy, EOS ignored), is run `num_iters_warmup` times untimed and
`num_iters` times timed. The prefix cache is reset before every iteration, so each one
pays for the full prefill rather than hitting the previous iteration's blocks.

Also home to the per-request latency metrics shared by the other benchmarks
(`request_latency_stats`: TTFT, TPOT, end-to-end latency, following vLLM's definitions).
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterable, Sequence

import numpy as np

from jaxserve.bench.workload import fixed
from jaxserve.request import FinishReason
from jaxserve.sampling.params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def percentiles(values: Sequence[float], ps: Iterable[int] = PERCENTILES) -> dict[str, float]:
    """{"10": p10, ...} with numpy's linear interpolation (vLLM's convention)."""
    arr = np.asarray(values, dtype=np.float64)
    return {str(p): float(np.percentile(arr, p)) for p in ps}


def _summary(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/p99 of `values_s` (seconds) as `mean_{name}_ms` etc.; NaN when empty."""
    if not values_s:
        return {f"{k}_{name}_ms": float("nan") for k in ("mean", "median", "p99")}
    ms = np.asarray(values_s) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def request_latency_stats(outputs: Sequence[Any]) -> dict[str, float]:
    """TTFT, TPOT and end-to-end latency (E2EL) over finished RequestOutputs.

    TTFT = first_token_time - arrival_time; E2EL = finished_time - arrival_time;
    TPOT = (E2EL - TTFT) / (output_len - 1), over requests with more than one token.
    """
    ttft, tpot, e2el = [], [], []
    for out in outputs:
        m = out.metrics
        if m is None or m.first_token_time is None or m.finished_time is None:
            continue
        first, total = m.first_token_time - m.arrival_time, m.finished_time - m.arrival_time
        ttft.append(first)
        e2el.append(total)
        n = len(out.outputs[0].token_ids)
        if n > 1:
            tpot.append((total - first) / (n - 1))
    return {**_summary("ttft", ttft), **_summary("tpot", tpot), **_summary("e2el", e2el)}


def run_latency(llm: Any, *, batch_size: int, input_len: int, output_len: int,
                num_iters: int, num_iters_warmup: int, seed: int = 0) -> dict[str, Any]:
    """Time `num_iters` generations of one fixed batch; returns vLLM's latency JSON fields."""
    if min(batch_size, input_len, output_len, num_iters) < 1 or num_iters_warmup < 0:
        raise ValueError("batch size, input/output length and --num-iters must be >= 1, "
                         "--num-iters-warmup >= 0")
    wl = fixed(llm.model_config.vocab_size, batch_size, input_len, output_len, seed=seed)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def once() -> float:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for _ in range(num_iters_warmup):
        once()
    compiles0 = llm.num_compiles
    latencies = [once() for _ in range(num_iters)]
    avg = float(np.mean(latencies))
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "num_iters": num_iters, "num_iters_warmup": num_iters_warmup,
        "avg_latency": avg,
        "latencies": latencies,
        "percentiles": percentiles(latencies),
        "output_tokens_per_s": batch_size * output_len / avg,
        "recompiles": llm.num_compiles - compiles0,
    }


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `n` requests arrives (rate inf: all at 0)."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [float(x) for x in np.cumsum(gaps) - gaps[0]]


def run_online(llm: Any, prompts: Sequence[list[int]], output_len: int, rate: float, *,
               seed: int = 0, time_limit: float = 600.0) -> dict[str, Any]:
    """Requests arrive as a seeded Poisson process while the engine steps, in-process:
    what a server's client would see, without HTTP. Timestamps are taken when a step's
    outputs reach the caller (with pipelined steps: one step after dispatch, as in the
    server). TTFT = first token - arrival; ITL = every gap between a request's tokens.
    Stops after `time_limit` seconds (unfinished requests are counted)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    seen: dict[str, list[float]] = {}       # rid -> [arrival, token times...]
    counts: dict[str, int] = {}
    core, i, t0 = llm.engine, 0, time.perf_counter()
    while (i < len(prompts) or core.has_unfinished_requests()) and \
            time.perf_counter() - t0 < time_limit:
        now = time.perf_counter() - t0
        while i < len(prompts) and arrivals[i] <= now:
            rid = llm.add_request({"prompt_token_ids": list(prompts[i])}, params)
            seen[rid], counts[rid] = [t0 + arrivals[i]], 0
            i += 1
        if not core.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, arrivals[i] - now)))
            continue
        outputs, stopped = llm.processor.process(core.step())
        if stopped:
            core.finish_requests(stopped, FinishReason.STOP)
        t = time.perf_counter()
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            seen[out.request_id].extend([t] * (n - counts[out.request_id]))
            counts[out.request_id] = n
    done = [v for rid, v in seen.items() if counts[rid] >= output_len]
    ttft = [v[1] - v[0] for v in done]
    itl = [b - a for v in done for a, b in zip(v[1:], v[2:])]
    duration = time.perf_counter() - t0
    return {"request_rate": rate, "num_prompts": len(prompts), "completed": len(done),
            "duration_s": duration, "output_tokens_per_s": len(done) * output_len / duration,
            "num_itl": len(itl),
            **_summary("ttft", ttft), **_summary("itl", itl)}


def main(ns: Any, args: Any) -> int:
    from jaxserve import LLM
    llm = LLM(**vars(args))
    res = run_latency(llm, batch_size=ns.batch_size, input_len=ns.input_len,
                      output_len=ns.output_len, num_iters=ns.num_iters,
                      num_iters_warmup=ns.num_iters_warmup, seed=ns.workload_seed)
    print(f"Avg latency: {res['avg_latency']:.4f} seconds")
    for p, v in res["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    print(f"Output throughput: {res['output_tokens_per_s']:.1f} tok/s; "
          f"recompiles after warm-up: {res['recompiles']}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
