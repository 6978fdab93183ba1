#!/usr/bin/env python
"""Prefix caching on vs off, side by side in one run (issue: prefix caching).

Workloads (seeded, random token ids, greedy, EOS ignored):
  shared_prefix  N requests sharing one P-token system prompt, each with its own S-token
                 suffix (default 64 x (1024 + 32), 16 output tokens)
  multi_turn     C conversations x K turns; turn k's prompt = turn k-1's prompt + its
                 answer + a new 32-token user message (turns run one after another)
  shared         the shared offline workload (no sharing: the cache's overhead)
Reports mean/p50/p90 TTFT, output throughput and the prefix-cache hit rate.

    .venv/bin/python -m benchmarks.prefix_cache [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.bench.workload import shared_offline, shared_prefix


def ttfts(outs) -> np.ndarray:
    return np.array([o.metrics.first_token_time - o.metrics.arrival_time for o in outs])


def run_batch(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[list, float]:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def multi_turn(llm: LLM, convs: int, turns: int, vocab: int, out_len: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(256)]
    hist = [list(system) for _ in range(convs)]
    all_outs, secs = [], 0.0
    for _ in range(turns):
        for h in hist:
            h.extend(rng.randrange(3, vocab) for _ in range(32))
        outs, s = run_batch(llm, hist, out_len)
        secs += s
        all_outs += outs
        for h, o in zip(hist, outs):
            h.extend(o.outputs[0].token_ids)
    return all_outs, secs


def summarize(name: str, outs, secs: float, llm: LLM) -> dict:
    t = ttfts(outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    st = llm.engine.kv_manager.stats
    return {"workload": name, "requests": len(outs), "seconds": secs,
            "ttft_mean_s": float(t.mean()), "ttft_p50_s": float(np.percentile(t, 50)),
            "ttft_p90_s": float(np.percentile(t, 90)), "output_tok_per_s": n_out / secs,
            "hit_rate": st.hit_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a few minutes)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    n, plen = (16, 512) if ns.quick else (64, 1024)
    rows = []
    for caching in (True, False):
        llm = LLM(enable_prefix_caching=caching, max_model_len=2048)
        V = llm.model_config.vocab_size
        wl = shared_prefix(V, num_prompts=n, prefix_len=plen, suffix_len=32, output_len=16)
        outs, secs = run_batch(llm, wl.prompts, wl.output_len)
        rows.append({"cache": caching, **summarize(f"shared_prefix {n}x({plen}+32)", outs, secs, llm)})
        llm.reset_prefix_cache()
        outs, secs = multi_turn(llm, 8 if ns.quick else 16, 3 if ns.quick else 4, V, 16)
        rows.append({"cache": caching, **summarize("multi_turn", outs, secs, llm)})
        wl = shared_offline(V, num_prompts=16 if ns.quick else 64)
        outs, secs = run_batch(llm, wl.prompts, wl.output_len)
        rows.append({"cache": caching, **summarize("shared (no sharing)", outs, secs, llm)})
        del llm
    print("\n| workload | cache | mean TTFT s | p90 TTFT s | output tok/s | hit rate |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {'on' if r['cache'] else 'off'} | {r['ttft_mean_s']:.2f} | "
              f"{r['ttft_p90_s']:.2f} | {r['output_tok_per_s']:.1f} | {r['hit_rate']:.0%} |")
    by = {(r["workload"], r["cache"]): r for r in rows}
    for w in dict.fromkeys(r["workload"] for r in rows):
        on, off = by[(w, True)], by[(w, False)]
        print(f"{w}: TTFT off/on = {off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x, "
              f"throughput on/off = {on['output_tok_per_s'] / off['output_tok_per_s']:.2f}x")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
