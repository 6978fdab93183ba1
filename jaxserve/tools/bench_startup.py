#!/usr/bin/env python
"""First vs second start: run twice in fresh processes against empty caches (XLA's
persistent cache $JAXSERVE_CACHE/xla and the compiled step programs
$JAXSERVE_CACHE/executables); prints start time, warm-up time, the programs compiled at
warm-up and compiles after it.

    .venv/bin/python -m jaxserve.tools.bench_startup [--max-model-len 512]
    .venv/bin/python -m jaxserve.tools.bench_startup --serve [--port 8123] [--jaxserve EXE]
    .venv/bin/python -m jaxserve.tools.bench_startup --config configs/gpu_h200_llama3-8b.yaml \
        --layers 1 [--platform gpu]

--serve times `jaxserve serve` with its defaults instead (targets: cold < 60 s, warm
< 5 s): from the process start to the first 200 of /health and to the first
completion, then the server is stopped by PID; the second start loads the first one's
stored step programs (worker/executables.py). With --jaxserve given more than once
(installs of two checkouts, or a script running one), each gets its own cache and the
starts alternate between them: every first start, then --warm-starts rounds.
--config builds that config's engine (its buckets, rows and limits) on bfloat16 weights
(zeros) of Llama-3-8B's sizes with --layers layers (1 layer: ~1.3 GB), the step as --platform would build it (gpu:
fused, branch-free sampler), and times the engine's construction and warm-up.
JAXSERVE_EXECUTABLE_CACHE=0 in the environment turns the stored step programs off
(worker/executables.py): the persistent XLA cache alone.
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
                  "programs_compiled": n0, "compiles_after_warmup": llm.num_compiles - n0}))
"""

CONFIG_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import jax
from jaxserve.config import EngineArgs
from jaxserve.frontend.llm import LLM
from jaxserve.model.config import ModelConfig
from jaxserve.model.params import is_spec, param_specs
from jaxserve.tools.device_check_engine import LLAMA3_8B
from jaxserve.worker import step_config
config, layers, platform = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if platform != "cpu":
    step_config.step_platform = lambda plan: platform
args = EngineArgs.from_sources(config)
cfg = ModelConfig(architecture="LlamaForCausalLM", family="llama",
                  **dict(LLAMA3_8B, num_layers=layers))
# zeros: the values do not matter to compiling, and no float32 draw doubles the memory
weights = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, jax.numpy.bfloat16),
                                 param_specs(cfg), is_leaf=is_spec)
kw = {f: getattr(args, f) for f in ("max_model_len", "block_size", "max_num_seqs",
                                    "max_num_batched_tokens", "token_buckets",
                                    "long_prefill_token_threshold")}
t1 = time.perf_counter()
llm = LLM.from_weights(cfg, weights, None, skip_tokenizer_init=True, dtype="bfloat16",
                       step_mode="fused" if platform != "cpu" else "auto",
                       num_kv_blocks=-(-args.max_model_len // args.block_size) + 1,
                       enable_prefix_caching=False, **kw)
store = llm.engine.runner.executables
print(json.dumps({"imports_and_weights_s": round(t1 - t0, 1),
                  "engine_s": round(time.perf_counter() - t1, 1),
                  "warmup_s": round(llm.engine.warmup_seconds, 1),
                  "programs_compiled": llm.num_compiles,
                  "programs_loaded": store.loaded if store is not None else 0}))
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
            time.sleep(0.05)
        healthy = time.perf_counter() - t0
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": httpx.get(url + "/v1/models").json()["data"][0]["id"],
            "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        return {"healthy_s": round(healthy, 2),
                "first_completion_s": round(time.perf_counter() - t0, 2)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_rounds(ns: argparse.Namespace) -> None:
    """First starts, then warm starts, alternating between the --jaxserve executables,
    each in its own fresh cache (the converted model linked in); medians at the end."""
    import statistics
    from jaxserve.paths import cache_root
    exes = ns.jaxserve or [str(Path(sys.executable).with_name("jaxserve"))]
    warm: dict[str, list[float]] = {e: [] for e in exes}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {}
        for i, exe in enumerate(exes):
            root = Path(tmp) / str(i)
            root.mkdir()
            (root / "models").symlink_to(cache_root() / "models", target_is_directory=True)
            envs[exe] = dict(os.environ, JAXSERVE_CACHE=str(root))
        for rnd in range(1 + ns.warm_starts):
            for exe in exes:
                row = serve_start(envs[exe], ns.port, exe, extra=ns.serve_arg)
                if rnd:
                    warm[exe].append(row["healthy_s"])
                name = "first start" if rnd == 0 else f"warm start {rnd}"
                print(f"serve {exe}, {name}: {json.dumps(row)}", flush=True)
    for exe, times in warm.items():
        if times:
            print(f"serve {exe}: warm starts to healthy {times}, median "
                  f"{statistics.median(times):.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--serve", action="store_true", help="time `jaxserve serve` starts")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--jaxserve", action="append", default=None,
                    help="--serve: the jaxserve executable to time (repeatable: alternated), "
                         "e.g. a runtime-only install's, what `make run` users start "
                         "(default: the one beside this Python)")
    ap.add_argument("--warm-starts", type=int, default=1,
                    help="--serve: warm starts after the first, per executable")
    ap.add_argument("--config", default=None, help="time this config's engine on random "
                    "Llama-3-8B-sized weights (see above)")
    ap.add_argument("--layers", type=int, default=1, help="--config: decoder layers")
    ap.add_argument("--platform", default="gpu", choices=("gpu", "tpu", "cpu"),
                    help="--config: build the step as on this platform")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="--serve: one more argument for `jaxserve serve` (repeatable), "
                         "e.g. --serve-arg=--decode-steps --serve-arg=1")
    ns = ap.parse_args()
    if ns.serve:
        return serve_rounds(ns)
    from jaxserve.paths import cache_root
    real = cache_root()
    with tempfile.TemporaryDirectory() as tmp:
        # reuse the converted model, start with empty XLA and kernel caches
        (Path(tmp) / "models").symlink_to(real / "models", target_is_directory=True)
        if ns.config and (real / "kernels").is_dir():   # programs only: C++ kernels built
            (Path(tmp) / "kernels").symlink_to(real / "kernels", target_is_directory=True)
        env = dict(os.environ, JAXSERVE_CACHE=tmp)
        for name in ("first start", "second start"):
            if ns.config:
                t = time.perf_counter()
                out = subprocess.run([sys.executable, "-c", CONFIG_CHILD, ns.config,
                                      str(ns.layers), ns.platform], env=env,
                                     capture_output=True, text=True, check=True).stdout
                print(f"{name}: {out.strip().splitlines()[-1]} "
                      f"(process {time.perf_counter() - t:.1f} s)", flush=True)
                continue
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, str(ns.max_model_len)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{name}: {json.dumps(row)} (process {time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
