#!/usr/bin/env python
"""Where an offline run spends its time: wall time per step shape (T tokens, P block-table
width) over the shared workload (jaxserve.bench.workload), default model.

    .venv/bin/python -m jaxserve.tools.profile_steps [--max-model-len 512] [--attention-backend cpu]
"""
from __future__ import annotations

import argparse
import collections
import time

import jaxserve.worker.runner as runner_mod
from jaxserve import LLM
from jaxserve.bench.throughput import run_throughput
from jaxserve.bench.workload import shared_offline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--attention-backend", default=None)
    ns = ap.parse_args()
    llm = LLM(None, dtype="float32", max_model_len=ns.max_model_len,
              attention_backend=ns.attention_backend, pipeline_steps=False)
    runner = llm.engine.runner
    log: list[dict] = []
    build = runner_mod.build_step_batch

    def spy_build(so, *a, **k):
        b = build(so, *a, **k)
        log.append({"shape": (int(b.tokens.shape[0]), int(b.md.block_tables.shape[1])),
                    "tokens": b.num_tokens})
        return b
    runner_mod.build_step_batch = spy_build
    execute = runner.execute

    def timed(so):
        t = time.perf_counter()
        r = execute(so)
        log[-1]["s"] = time.perf_counter() - t
        return r
    runner.execute = timed
    res = run_throughput(llm, shared_offline(llm.model_config.vocab_size))
    print(f"{res['seconds']:.1f} s, {res['output_tokens_per_s']:.1f} output tok/s, "
          f"{res['steps']} steps")
    agg: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in log:
        agg[e["shape"]][0] += 1
        agg[e["shape"]][1] += e["s"]
    total = sum(v[1] for v in agg.values())
    print("| (T, P) | steps | ms/step | share |\n|---|---|---|---|")
    for k, (n, s) in sorted(agg.items()):
        print(f"| {k} | {n} | {1000 * s / n:.0f} | {100 * s / total:.0f}% |")


if __name__ == "__main__":
    main()
