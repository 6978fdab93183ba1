#!/usr/bin/env python
"""First vs second start: run twice in fresh processes against an empty XLA cache
($JAXSERVE_CACHE/xla); prints start time, warm-up time and compiles after warm-up.

    .venv/bin/python scripts/bench_startup.py [--max-model-len 512]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from jaxserve import LLM, SamplingParams
llm = LLM(None, dtype="float32", max_model_len=int(sys.argv[1]))
t1 = time.perf_counter()
n0 = llm.num_compiles
llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 300, 17)],
             SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)
print(json.dumps({"start_s": t1 - t0, "warmup_s": llm.engine.warmup_seconds,
                  "compiles_after_warmup": llm.num_compiles - n0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-model-len", type=int, default=512)
    ns = ap.parse_args()
    from jaxserve.model.loader.default_model import cache_root
    real = cache_root()
    with tempfile.TemporaryDirectory() as tmp:
        # reuse the converted model, start with empty XLA and kernel caches
        (Path(tmp) / "models").symlink_to(real / "models", target_is_directory=True)
        env = dict(os.environ, JAXSERVE_CACHE=tmp)
        for name in ("first start", "second start"):
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, str(ns.max_model_len)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{name}: {json.dumps(row)} (process {time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
