#!/usr/bin/env python
"""Where a decode step's device time goes, per XLA op, for any step
form: the default model decodes `--tokens` tokens for `--batch` requests under
jax.profiler, and the ops XLA:CPU ran (thunks: our FFI kernel calls, fusions, copies)
are summed per step and per kind. jaxserve/tools/profile_step.py times the layerwise step's
pieces from the host; this sees inside one program (the fused step of small buckets).

    .venv/bin/python -m jaxserve.tools.trace_step [--batch 1] [--tokens 64] [--step-mode hybrid]

Prints ms per step of each op kind (name without its numeric suffix), the FFI calls
grouped by duration (one group ~ one kind of kernel call: q/k/v, o, gate/up, down,
attention, head), and the wall time per token of the traced run.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps traced")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--step-mode", default="auto")
    ap.add_argument("--top", type=int, default=20, help="op kinds printed")
    ap.add_argument("--greedy-head", default="auto", choices=("auto", "off"))
    args = ap.parse_args()

    import jax
    from jaxserve import LLM, SamplingParams
    llm = LLM(None, step_mode=args.step_mode, greedy_head=args.greedy_head)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + args.input_len))}
               for i in range(args.batch)]
    llm.generate(prompts, sp, use_tqdm=False)           # compiled, caches warm
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
        path = glob.glob(d + "/**/*.trace.json.gz", recursive=True)[0]
        trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = args.tokens + 1                    # the prefill step is in there too
    per_kind: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    ffi: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        name = e.get("name", "")
        if (e.get("ph") != "X" or "hlo_op" not in e.get("args", {})
                or name.startswith("end: ")):
            continue            # only the ops XLA ran (not Python frames, not markers)
        kind = re.sub(r"[.\d]+$", "", name)
        per_kind[kind] += e["dur"]
        count[kind] += 1
        if kind == "ffi_call":
            ffi[name].append(e["dur"])
    print(f"batch {args.batch}, {args.tokens} tokens, step mode {args.step_mode}: "
          f"{1000 * wall / args.tokens:.1f} ms per token (wall, traced)")
    print("| op kind | ms / step | calls / step |\n|---|---|---|")
    for kind, us in per_kind.most_common(args.top):
        print(f"| {kind} | {us / 1000 / steps:.2f} | {count[kind] / steps:.0f} |")
    groups: dict[int, list[float]] = collections.defaultdict(list)
    for durs in ffi.values():
        if len(durs) < args.tokens // 2:
            continue            # an op of the prefill program, not of every decode step
        med = sorted(durs)[len(durs) // 2]
        groups[int(round(med / 10) * 10 if med < 100 else round(med / 25) * 25)].append(med)
    print("\n| FFI call in every decode step (median us) | calls / step | ms / step |\n|---|---|---|")
    for g in sorted(groups):
        print(f"| ~{g} | {len(groups[g])} | {sum(groups[g]) / 1000:.2f} |")


if __name__ == "__main__":
    main()
