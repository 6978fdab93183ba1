#!/usr/bin/env python
"""Two checkouts of jaxserve side by side: decode tok/s of the default model in float32
at each batch size, alternating A, B, A, B, ... in fresh processes, and whether the two
produce the same tokens. Greedy by default; --temperature T (with --top-p) samples
instead, every request seeded, so the two checkouts must still draw the same tokens.
For a change that must not move results or speed (a refactor, a sampler rewrite): run
it against the commit before the change.

    git worktree add /tmp/before <commit>
    .venv/bin/python -m benchmarks.ab_checkouts /tmp/before . [--pairs 3] [--batch-sizes 1 8]
        [--temperature 0.8 --top-p 0.95]

Each run imports jaxserve from its checkout (PYTHONPATH) with this interpreter, in its own
`$JAXSERVE_CACHE` under the system temp dir (a checkout may change the cache's formats),
and uses only the public API (LLM, SamplingParams), so an older checkout runs too. Decode
tok/s = batch x 127 / (median time of a 128-token run - median of a 1-token run), three
timed runs each after one warm run; prompts of 32 random token ids, seed 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT_LEN, OUTPUT_LEN, TIMED = 32, 128, 3


def child(batch_sizes: list[int], temperature: float = 0.0, top_p: float = 1.0) -> dict:
    import time

    import numpy as np

    import jaxserve
    from jaxserve import LLM, SamplingParams
    print("jaxserve from", Path(jaxserve.__file__).parent, file=sys.stderr)
    try:        # float32 weights: checkouts that serve the GGUF file's blocks by default
        llm = LLM(None, dtype="float32", quantization="none", max_model_len=512)
    except ValueError:      # older checkouts: float32 is their default
        llm = LLM(None, dtype="float32", max_model_len=512)
    rng = np.random.default_rng(0)
    out: dict = {}
    for b in batch_sizes:
        prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, PROMPT_LEN)]}
                   for _ in range(b)]

        def timed(n: int) -> tuple[float, list]:
            params = SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p,
                                    seed=0 if temperature > 0 else None, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)
            times, res = [], []
            for _ in range(TIMED):
                t = time.perf_counter()
                res = llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - t)
            return statistics.median(times), res
        full, res = timed(OUTPUT_LEN)
        first, _ = timed(1)
        out[str(b)] = {"decode_tok_s": b * (OUTPUT_LEN - 1) / (full - first),
                       "tokens": [list(r.outputs[0].token_ids) for r in res]}
    return out


def run_one(checkout: Path, cache: Path, batch_sizes: list[int], sampling: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), JAXSERVE_CACHE=str(cache),
               HF_HUB_OFFLINE="1")
    # run as a file, from the cache dir: `-m` would put this checkout's root (and its
    # jaxserve) ahead of PYTHONPATH
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                           *sampling, *map(str, batch_sizes)], env=env, capture_output=True,
                          text=True, timeout=1800, cwd=cache)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{checkout}: run failed\n{proc.stderr[-3000:]}")
    if f"jaxserve from {checkout / 'jaxserve'}" not in proc.stderr:
        raise SystemExit(f"{checkout}: the run imported another jaxserve\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        temperature, top_p, *sizes = sys.argv[2:]
        print("RESULT", json.dumps(child([int(b) for b in sizes], float(temperature),
                                         float(top_p))))
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="checkout A (e.g. the commit before a change)")
    ap.add_argument("b", type=Path, help="checkout B")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above 0: seeded sampling at this temperature")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ab_checkouts_"))
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for i in range(ns.pairs):
        for side in ("a", "b"):
            r = run_one(getattr(ns, side).resolve(), tmp / side, ns.batch_sizes,
                        [str(ns.temperature), str(ns.top_p)])
            runs[side].append(r)
            print(f"pair {i + 1} {side}: " + ", ".join(
                f"batch {b} {r[str(b)]['decode_tok_s']:.1f} tok/s" for b in ns.batch_sizes),
                flush=True)
    print(f"\n| batch | A tok/s (runs) | B tok/s (runs) | B / A (medians) | same tokens |")
    print("|---|---|---|---|---|")
    summary = {}
    for b in map(str, ns.batch_sizes):
        a = [r[b]["decode_tok_s"] for r in runs["a"]]
        bb = [r[b]["decode_tok_s"] for r in runs["b"]]
        same = all(r[b]["tokens"] == runs["a"][0][b]["tokens"] for r in runs["a"] + runs["b"])
        ratio = statistics.median(bb) / statistics.median(a)
        summary[b] = {"a": a, "b": bb, "ratio": ratio, "same_tokens": same}
        print(f"| {b} | {', '.join(f'{x:.1f}' for x in a)} | {', '.join(f'{x:.1f}' for x in bb)} "
              f"| {ratio:.2f}x | {'yes' if same else 'NO'} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
