#!/usr/bin/env python
"""LoRA serving costs on the default model, every engine built and run in one process
(the machine is shared: compare the ratios within one run).

  throughput   the shared offline workload (its first --prompts prompts, --max-tokens
               output tokens each) on an engine without LoRA, then on LoRA engines of
               rank R with --max-loras A, the requests spread round-robin over A random
               adapters (all seven targets), for every R in --ranks and A in --adapters
  decode       decode time per token at batch 1 and batch 64 (16-token prompts; the time
               of a generate with 1 + --decode-tokens outputs minus one with a single
               output, over --decode-tokens), each row with its own adapter (batch 1:
               adapter 0; base engine: no adapter)
  swap         writing an adapter into a device slot (LoRASlots.write: padding on the
               host, host -> device copy, the donated in-place update), ms, median of 5

One JSON line per engine, as each finishes (a run cut short keeps what it printed).

    .venv/bin/python -m benchmarks.lora [--prompts 16] [--max-tokens 16] [--ranks 8 64]
        [--adapters 1 4 16] [--decode-tokens 16]
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.bench.workload import fixed, shared_offline
from jaxserve.tools.bench_lora import save_random_adapter

BUCKETS = [8, 64, 256]          # batch-1 decode (gathered delta), batch 64, prefill


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int, loras: list[Any]) -> float:
    from jaxserve.sampling.params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                 lora_request=loras)
    return time.perf_counter() - t


def measure(llm: Any, ns: argparse.Namespace, work: Any, loras: list[Any]) -> dict[str, Any]:
    """Throughput and decode ms a token for one engine; loras: one per workload request
    (None: the base model), cycled for the decode batches."""
    out: dict[str, Any] = {}
    _generate(llm, work.prompts[:2], 2, loras[:2])                          # warm
    secs = _generate(llm, work.prompts, ns.max_tokens, loras)
    out["tok_s"] = len(work.prompts) * ns.max_tokens / secs
    short = fixed(llm.model_config.vocab_size, 64, 16, 1).prompts
    for batch in (1, 64):
        rows = [loras[i % len(loras)] for i in range(batch)]
        _generate(llm, short[:batch], 2, rows)                                # warm
        first = _generate(llm, short[:batch], 1, rows)
        full = _generate(llm, short[:batch], 1 + ns.decode_tokens, rows)
        out[f"decode_ms_b{batch}"] = 1e3 * (full - first) / ns.decode_tokens
    return out


def swap_ms(llm: Any, adapters: list[Any]) -> float:
    """Bypasses the slot map: the engine must serve nothing after it."""
    slots, weights = llm.engine.runner.lora_slots, llm.engine.runner.weights
    times = []
    for i in range(6):                  # a different adapter into slot 1 each time
        t = time.perf_counter()
        slots.write(weights, 1, adapters[i % len(adapters)])
        jax.block_until_ready(weights["layers"][-1]["lora"])
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--decode-tokens", type=int, default=16)
    ns = p.parse_args()
    from jaxserve.frontend.llm import LLM
    from jaxserve.lora import LoRARequest
    from jaxserve.model.loader.load import load_model
    m = load_model(None, progress=False, quantization="none")
    cfg = m.config
    work = shared_offline(cfg.vocab_size, num_prompts=ns.prompts, output_len=ns.max_tokens)
    args = dict(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=256,
                token_buckets=BUCKETS)
    print(json.dumps({"device": str(jax.devices()[0]), "prompts": ns.prompts,
                      "prompt_tokens": work.num_prompt_tokens, "max_tokens": ns.max_tokens,
                      "buckets": BUCKETS}), flush=True)
    t = time.perf_counter()
    llm = LLM.from_weights(cfg, m.weights, m.tokenizer, **args)
    row: dict[str, Any] = {"engine": "base", "build_s": time.perf_counter() - t}
    row.update(measure(llm, ns, work, [None] * len(work.prompts)))
    print(json.dumps(row), flush=True)
    del llm
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        for rank in ns.ranks:
            reqs = [LoRARequest(f"r{rank}a{i}", 1 + i, str(save_random_adapter(
                Path(tmp) / f"r{rank}a{i}", cfg, rank, i))) for i in range(max(ns.adapters))]
            for n in ns.adapters:
                t = time.perf_counter()
                llm = LLM.from_weights(cfg, m.weights, m.tokenizer, enable_lora=True,
                                       max_loras=n, max_lora_rank=rank,
                                       max_cpu_loras=max(ns.adapters), **args)
                row = {"engine": f"lora {n} x {rank}", "build_s": time.perf_counter() - t}
                spread = [reqs[i % n] for i in range(len(work.prompts))]
                row.update(measure(llm, ns, work, spread))
                assert llm.lora_registry is not None
                row["swap_ms"] = swap_ms(llm, [llm.lora_registry.get(r) for r in reqs[:2]])
                print(json.dumps(row), flush=True)
                del llm
                gc.collect()      # 16 x 64 slot arrays alone are 1.3 GB


if __name__ == "__main__":
    main()
