#!/usr/bin/env python
"""First vs second start: run twice in fresh processes against an empty XLA cache
($JAXSERVE_CACHE/xla); prints start time, warm-up time and compiles after warm-up.

    .venv/bin/python -m jaxserve.tools.bench_startup [--max-model-len 512]
    .venv/bin/python -m jaxserve.tools.bench_startup --serve [--port 8123] [--jaxserve EXE]

--serve times `jaxserve serve` with its defaults instead (targets: cold < 60 s, warm
< 10 s): from the process start to the first 200 of /health and to the first
completion, then the server is stopped by PID; the second start finds the first one's
compiled programs in the persistent cache.
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


def serve_start(env: dict[str, str], port: int, exe: str, limit_s: float = 600.0,
                extra: list[str] | None = None) -> dict:
    """Seconds from spawning `jaxserve serve` to /health = 200 and to a completion."""
    import httpx
    t0 = time.perf_counter()
    proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", str(port),
                             *(extra or [])],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jaxserve serve exited with {proc.returncode}")
            if time.perf_counter() - t0 > limit_s:
                raise TimeoutError(f"not healthy after {limit_s:.0f} s")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        healthy = time.perf_counter() - t0
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": httpx.get(url + "/v1/models").json()["data"][0]["id"],
            "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        return {"healthy_s": round(healthy, 1),
                "first_completion_s": round(time.perf_counter() - t0, 1)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--serve", action="store_true", help="time `jaxserve serve` starts")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--jaxserve", default=str(Path(sys.executable).with_name("jaxserve")),
                    help="--serve: the jaxserve executable to time, e.g. a runtime-only "
                         "install's (what `make run` users start: no torch, whose import "
                         "through transformers adds ~1.5 s where the test extras are in)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="--serve: one more argument for `jaxserve serve` (repeatable), "
                         "e.g. --serve-arg=--decode-steps --serve-arg=1")
    ns = ap.parse_args()
    from jaxserve.paths import cache_root
    real = cache_root()
    with tempfile.TemporaryDirectory() as tmp:
        # reuse the converted model, start with empty XLA and kernel caches
        (Path(tmp) / "models").symlink_to(real / "models", target_is_directory=True)
        env = dict(os.environ, JAXSERVE_CACHE=tmp)
        for name in ("first start", "second start"):
            if ns.serve:
                print(f"serve, {name}: {json.dumps(serve_start(env, ns.port, ns.jaxserve, extra=ns.serve_arg))}", flush=True)
                continue
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, str(ns.max_model_len)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{name}: {json.dumps(row)} (process {time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
