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
