#!/usr/bin/env python
"""Side-by-side offline throughput: jaxserve vs transformers `generate` (static batches of
16, left-padded) and `generate_batch` (transformers' continuous batching), in one run, on
the shared workload (bench/workload.py) with the same weights (SmolLM2-135M-Instruct by default).

    .venv/bin/python scripts/bench_vs_hf.py [--num-prompts 64] [--output-len 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from jaxserve import LLM
from jaxserve.bench.throughput import achieved_flops, run_throughput
from jaxserve.bench.workload import shared_offline
from jaxserve.model.export import to_transformers


def hf_model_from(llm: LLM) -> transformers.PreTrainedModel:
    return to_transformers(llm.model_config, llm.engine.runner.weights)


def bench_hf_static(model, prompts: list[list[int]], output_len: int, pad_id: int,
                    batch: int = 16) -> dict:
    gen = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                        do_sample=False, pad_token_id=pad_id)
    t0 = time.perf_counter()
    n_out = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            L = max(len(p) for p in chunk)
            ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
            n_out += (out.shape[1] - L) * len(chunk)
    secs = time.perf_counter() - t0
    return {"seconds": secs, "output_tokens_per_s": n_out / secs}


def bench_hf_batch(model, prompts: list[list[int]], output_len: int, pad_id: int) -> dict:
    gen = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                        do_sample=False, pad_token_id=pad_id, eos_token_id=-1)
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate_batch(prompts, generation_config=gen)
    secs = time.perf_counter() - t0
    n_out = sum(len(r.generated_tokens) for r in res.values())
    return {"seconds": secs, "output_tokens_per_s": n_out / secs}


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
