#!/usr/bin/env python
"""Latency-aware defaults: for each scheduler setting, a fresh engine
(default model, fp32) runs, back to back,

  low load   Poisson --rate req/s of ~128-token random prompts, 64 output tokens each,
             in-process (bench.latency.run_online): mean/p99 ITL, mean TTFT
  offline    the shared workload (jaxserve.bench.workload): output tok/s (saturation)

Points: the old buckets (16..512, no bucket-fitting of chunks), then the defaults and
variations of the step budget and the long-prefill cap.

    .venv/bin/python -m benchmarks.sweep_low_load [--json out.json] [--num-prompts 24]
"""
from __future__ import annotations

import argparse
import gc
import json
import random

from jaxserve import LLM
from jaxserve.bench.latency import run_online
from jaxserve.bench.throughput import run_throughput
from jaxserve.bench.workload import shared_offline
from jaxserve.worker import buckets as buckets_mod

OLD_BUCKETS = [16, 32, 64, 128, 256, 512]
POINTS: list[tuple[str, dict, bool]] = [     # (label, EngineArgs overrides, fit chunks)
    ("before: buckets 16..512, budget 512", {"token_buckets": OLD_BUCKETS}, False),
    ("buckets 1..512, budget 512, no chunk fitting", {}, False),
    ("default: buckets 1..512, budget 512", {}, True),
    ("budget 256", {"max_num_batched_tokens": 256}, True),
    ("budget 128", {"max_num_batched_tokens": 128}, True),
    ("budget 512, long-prefill cap 64", {"long_prefill_token_threshold": 64}, True),
]


def low_load_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)     # ~128 tokens (96..160), like `bench serve --range-ratio .25`
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(96, 160))] for _ in range(n)]


def run_point(overrides: dict, fit: bool, ns: argparse.Namespace) -> dict:
    orig = buckets_mod.BucketSet.fit_chunk
    if not fit:
        buckets_mod.BucketSet.fit_chunk = lambda self, used, wanted: wanted
    try:
        llm = LLM(None, dtype="float32", max_model_len=512, **overrides)
        prompts = low_load_prompts(ns.num_prompts, llm.model_config.vocab_size)
        low = run_online(llm, prompts, 64, ns.rate, seed=0, time_limit=ns.time_limit)
        llm.reset_prefix_cache()
        off = run_throughput(llm, shared_offline(llm.model_config.vocab_size))
        return {"low": low, "offline": off, "warmup_s": llm.engine.warmup_seconds,
                "shapes": len(llm.engine.buckets.all_shapes())}
    finally:
        buckets_mod.BucketSet.fit_chunk = orig
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--time-limit", type=float, default=300.0, help="per low-load run")
    ap.add_argument("--points", type=int, nargs="*", default=None, help="indices into POINTS")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    chosen = [POINTS[i] for i in ns.points] if ns.points else POINTS
    rows = []
    print("| setting | low load: mean ITL ms | p99 ITL ms | mean TTFT ms | "
          "offline output tok/s | shapes |\n|---|---|---|---|---|---|", flush=True)
    for label, overrides, fit in chosen:
        r = run_point(overrides, fit, ns)
        rows.append({"label": label, "overrides": overrides, "fit_chunk": fit, **r})
        lo = r["low"]
        print(f"| {label} | {lo['mean_itl_ms']:.1f} | {lo['p99_itl_ms']:.0f} | "
              f"{lo['mean_ttft_ms']:.0f} | {r['offline']['output_tokens_per_s']:.1f} | "
              f"{r['shapes']} |", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
