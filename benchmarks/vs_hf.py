#!/usr/bin/env python
"""Side-by-side offline throughput: jaxserve vs transformers `generate` (static batches of
16, left-padded) and `generate_batch` (transformers' continuous batching), in one run, on
the shared workload (jaxserve.bench.workload) with the same weights (SmolLM2-135M-Instruct by default).

    .venv/bin/python -m benchmarks.vs_hf [--num-prompts 64] [--output-len 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from jaxserve import LLM
from jaxserve.bench.throughput import achieved_flops, run_throughput
from jaxserve.bench.workload import shared_offline

from .harness import bench_hf_batch, bench_hf_static, hf_model_from


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512,
                    help="jaxserve's max_model_len (the workload needs <= 320)")
    ap.add_argument("--skip-generate-batch", action="store_true")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    llm = LLM(ns.model, dtype="float32", max_model_len=ns.max_model_len)
    wl = shared_offline(llm.model_config.vocab_size, num_prompts=ns.num_prompts,
                        output_len=ns.output_len)
    jx = run_throughput(llm, wl)
    jx["achieved_gflops"] = achieved_flops(llm.model_config, jx) / 1e9
    model = hf_model_from(llm)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    rows = {"jaxserve": jx, "hf_generate_static16": bench_hf_static(model, wl.prompts,
                                                                   wl.output_len, pad)}
    if not ns.skip_generate_batch:
        rows["hf_generate_batch"] = bench_hf_batch(model, wl.prompts, wl.output_len, pad)
    print(f"\nshared workload: {len(wl.prompts)} prompts, {wl.num_prompt_tokens} prompt tokens, "
          f"{wl.output_len} output tokens each, greedy, fp32\n")
    print("| engine | seconds | output tok/s | jaxserve speed-up |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        ratio = jx["output_tokens_per_s"] / r["output_tokens_per_s"]
        print(f"| {name} | {r['seconds']:.1f} | {r['output_tokens_per_s']:.1f} | {ratio:.2f}x |")
    print(f"\njaxserve: {jx['achieved_gflops']:.1f} GFLOP/s achieved, "
          f"{jx['host_ms_per_step']:.2f} ms host time per step (batch building + token "
          f"handling) + {jx['overlapped_ms_per_step']:.2f} ms output processing overlapped "
          f"with the device, {jx['steps']} steps, {jx['recompiles']} recompiles")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
