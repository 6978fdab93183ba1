#!/usr/bin/env python
"""jaxserve vs llama.cpp on the same CPU, side by side in one run.

llama.cpp (`llama-server`, `llama-batched-bench`) is built once from the source tree in
PyPI's llama-cpp-python sdist (benchmarks/harness.py; cached in
$JAXSERVE_CACHE/llamacpp). Both engines read the same file, --format (each engine's
best setting for it):

  F32   a GGUF written from jaxserve's float32 weights; jaxserve: --quantization none
  Q8_0  the same weights quantized to Q8_0 by gguf-py; jaxserve: that file's blocks
        (--quantization gguf)
  Q4_1  the embedded GGUF itself; jaxserve: the default model (its blocks)

Measured, in this order:

  decode   batch 1/8/64, --input-len prompt tokens, --output-len generated tokens:
           decode tok/s = B x (out - 1) / (latency(out) - latency(1)) for jaxserve
           (`bench latency`'s run, minus its prefill), S_TG of llama-batched-bench
  offline  the shared workload (jaxserve.bench.workload): jaxserve's offline engine vs llama-server
           given all 64 requests at once (16 slots); and both servers given all 64 at
           once (the first load each server sees: no prompt is cached yet)
  serving  `jaxserve bench serve` against `jaxserve serve` and `llama-server`: low load
           (Poisson --low-rate req/s, ~128-token prompts, 64 out) and high load (the
           shared workload at Poisson --high-rate req/s)

Servers bind 127.0.0.1 and are stopped by PID; every load run is bounded in requests
and in time. Prints a markdown table and writes JSON.

    .venv/bin/python -m benchmarks.vs_llamacpp [--format Q4_1] [--json out.json]
    .venv/bin/python -m benchmarks.vs_llamacpp --offline-pairs 4
    .venv/bin/python -m benchmarks.vs_llamacpp --decode-pairs 7 --batch-sizes 1

--offline-pairs N: only the shared offline workload, N times a pair run back to back
(`jaxserve bench throughput` in a fresh process; llama-server started, given all 64
requests at once, stopped), the order alternating: on a machine whose speed drifts, the
ratio within a pair is the number to read.
--decode-pairs N: only the decode rows (--batch-sizes), N pairs of the two measurements
above (jaxserve's in this process, its engine loaded once; llama-batched-bench), back to
back, the order alternating; each pair's ratio per batch size and their medians.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from jaxserve import LLM
from jaxserve.bench.latency import run_latency
from jaxserve.bench.throughput import run_throughput
from jaxserve.bench.workload import shared_offline

from . import harness
from .harness import PY, THREADS, Server, bench_serve, llamacpp_decode


FORMATS = ("F32", "Q8_0", "Q4_1")


def jaxserve_model_args(fmt: str, int8_acts: bool = False) -> list[str]:
    """`jaxserve serve` / `bench throughput` flags that load the --format file
    (int8_acts: with --cpu-int8-activations)."""
    extra = ["--cpu-int8-activations"] if int8_acts else []
    if fmt == "F32":
        return ["--quantization", "none", *extra]
    if fmt == "Q8_0":
        return ["--model", str(harness.gguf_for_default_model(fmt)), "--quantization", "gguf",
                *extra]
    return extra


def engine_and_file(fmt: str, int8_acts: bool = False) -> tuple[LLM, Path]:
    """jaxserve's in-process engine for --format and the GGUF llama.cpp reads."""
    gguf = harness.gguf_for_default_model(fmt)
    kw = dict(dtype="float32", max_model_len=512, cpu_int8_activations=int8_acts)
    if fmt == "F32":
        return LLM(None, quantization="none", **kw), gguf
    if fmt == "Q8_0":
        return LLM(str(gguf), quantization="gguf", **kw), gguf
    return LLM(None, **kw), gguf


def jaxserve_decode(llm: LLM, batch: int, input_len: int, output_len: int,
                    iters: int) -> dict[str, float]:
    kw = dict(batch_size=batch, input_len=input_len, num_iters=iters, num_iters_warmup=1)
    full = run_latency(llm, output_len=output_len, **kw)
    prefill = run_latency(llm, output_len=1, **kw)
    decode_s = full["avg_latency"] - prefill["avg_latency"]
    return {"decode_tok_s": batch * (output_len - 1) / decode_s,
            "e2e_tok_s": full["output_tokens_per_s"], "prefill_s": prefill["avg_latency"],
            "recompiles": full["recompiles"] + prefill["recompiles"]}


def greedy_text(url: str, prompt: list[int], n: int = 24) -> str:
    """A greedy completion of token ids: the same weights must give the same text."""
    import httpx
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def serving_loads(ns: argparse.Namespace) -> dict[str, list[str]]:
    low = ["--workload", "random", "--input-len", "128", "--range-ratio", "0.25",
           "--output-len", "64", "--num-prompts", str(ns.low_prompts),
           "--request-rate", str(ns.low_rate)]
    # the high load's prompts are drawn with another seed than the offline run's: both
    # servers keep earlier prompts' KV (llama-server's slots cache them, jaxserve's prefix
    # cache is not reset between loads), so a repeated prompt would skip its prefill
    high = ["--workload", "shared", "--num-prompts", str(ns.high_prompts),
            "--output-len", "64", "--request-rate", str(ns.high_rate), "--seed", "1"]
    offline = ["--workload", "shared", "--num-prompts", "64", "--output-len", "64",
               "--request-rate", "inf"]
    # offline first: each server meets its prompts for the first time
    return {"offline_via_server": offline, "serve_low": low, "serve_high": high}


def prompt_tokens_evaluated(log: Path) -> int:
    """Prompt tokens llama-server has run through the model so far (its "prompt eval
    time = ... / N tokens" lines): a load whose prompts were cached evaluates fewer."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(int(n) for n in re.findall(r"prompt eval time =.*?/\s*(\d+) tokens", text))


def llama_server_cmd(ns: argparse.Namespace, bins: dict, gguf: Path) -> list[str]:
    return [str(bins["llama-server"]), "-m", str(gguf), "--host", "127.0.0.1", "--port",
            str(ns.port + 1), "-t", str(THREADS), "-tb", str(THREADS), "-np",
            str(ns.llama_slots), "-c", str(512 * ns.llama_slots), "-b", "2048", "-ub", "512"]


def run_servers(ns: argparse.Namespace, bins: dict, gguf: Path, work: Path) -> dict:
    """Each load against jaxserve's server, then against llama-server (one at a time)."""
    res: dict[str, dict] = {}
    js_cmd = [PY, "-m", "jaxserve.cli", "serve", "--max-model-len", "512", "--port",
              str(ns.port), "--host", "127.0.0.1",
              *jaxserve_model_args(ns.format, ns.int8_activations)]
    lc_cmd = llama_server_cmd(ns, bins, gguf)
    for name, cmd, port in (("jaxserve", js_cmd, ns.port), ("llama.cpp", lc_cmd, ns.port + 1)):
        srv = Server(cmd, port, work / f"{name}.server.log", ready_timeout=300)
        try:
            for load, args in serving_loads(ns).items():
                before = prompt_tokens_evaluated(srv.log_path)
                r = bench_serve(srv.url, args, work / f"{name}.{load}.json",
                                ns.serve_time_limit)
                if name == "llama.cpp":
                    r["prompt_tokens_evaluated"] = prompt_tokens_evaluated(srv.log_path) - before
                res.setdefault(load, {})[name] = r
            # last, so its 64 tokens are not in either cache during the loads
            res.setdefault("parity", {})[name] = greedy_text(srv.url, ns.parity_prompt)
        finally:
            srv.stop()
    return res


def offline_pairs(ns: argparse.Namespace) -> None:
    """The offline workload alone, jaxserve and llama-server back to back N times (order
    alternating); prints each pair's ratio and the median."""
    bins = harness.build()
    gguf = harness.gguf_for_default_model(ns.format)
    work = harness.cache_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)

    def jaxserve() -> float:
        out = work / "jaxserve.json"
        subprocess.run([PY, "-m", "jaxserve.cli", "bench", "throughput", "--max-model-len",
                        "512", "--output-json", str(out),
                        *jaxserve_model_args(ns.format, ns.int8_activations)],
                       capture_output=True, check=True,
                       timeout=ns.serve_time_limit)
        return json.loads(out.read_text())["output_tokens_per_s"]

    def llamacpp() -> float:
        srv = Server(llama_server_cmd(ns, bins, gguf), ns.port + 1, work / "llama.cpp.log",
                     ready_timeout=300)
        try:
            r = bench_serve(srv.url, serving_loads(ns)["offline_via_server"],
                            work / "llama.cpp.json", ns.serve_time_limit)
        finally:
            srv.stop()
        if r["completed"] != 64:
            raise RuntimeError(f"llama-server completed {r['completed']} of 64: {r['errors']}")
        return r["output_throughput"]
    ratios, rows = [], []
    for i, got in alternated_pairs(ns.offline_pairs, jaxserve, llamacpp):
        ratios.append(got["jaxserve"] / got["llamacpp"])
        rows.append({**got, "ratio": ratios[-1]})
        print(f"pair {i + 1}: jaxserve {got['jaxserve']:.1f}, llama.cpp {got['llamacpp']:.1f} "
              f"output tok/s: {ratios[-1]:.2f}x", flush=True)
    med = statistics.median(ratios)
    print(f"median ratio of {len(ratios)} pairs: {med:.2f}x")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"pairs": rows, "median_ratio": med}, indent=2))


def alternated_pairs(n: int, jaxserve: Callable[[], Any],
                     llamacpp: Callable[[], Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """n pairs of the two measurements back to back, jaxserve first in even pairs: yields
    (i, {"jaxserve": ..., "llamacpp": ...}) (the machine drifts: compare within a pair)."""
    for i in range(n):
        order = (jaxserve, llamacpp) if i % 2 == 0 else (llamacpp, jaxserve)
        yield i, {f.__name__: f() for f in order}


def decode_pairs(ns: argparse.Namespace) -> None:
    """The decode rows alone: N pairs (jaxserve's batch sizes, then llama-batched-bench's,
    or the other way round), the order alternating; prints each pair's ratios and the
    medians per batch size."""
    bins = harness.build()
    llm, gguf = engine_and_file(ns.format, ns.int8_activations)

    def jaxserve() -> dict[int, float]:
        return {b: jaxserve_decode(llm, b, ns.input_len, ns.output_len,
                                   ns.num_iters)["decode_tok_s"] for b in ns.batch_sizes}

    def llamacpp() -> dict[int, float]:
        got = llamacpp_decode(bins, gguf, ns.batch_sizes, ns.input_len, ns.output_len)
        return {b: got[b]["decode_tok_s"] for b in ns.batch_sizes}
    rows: list[dict] = []
    for i, got in alternated_pairs(ns.decode_pairs, jaxserve, llamacpp):
        rows.append({str(b): {"jaxserve": got["jaxserve"][b], "llamacpp": got["llamacpp"][b],
                              "ratio": got["jaxserve"][b] / got["llamacpp"][b]}
                     for b in ns.batch_sizes})
        print(f"pair {i + 1} ({'jaxserve' if i % 2 == 0 else 'llama.cpp'} first): " + "; ".join(
            f"batch {b} {r['jaxserve']:.1f} / {r['llamacpp']:.1f} tok/s = {r['ratio']:.2f}x"
            for b, r in rows[-1].items()), flush=True)
    meds = {str(b): statistics.median([r[str(b)]["ratio"] for r in rows])
            for b in ns.batch_sizes}
    print("median ratio of " + str(len(rows)) + " pairs: " +
          ", ".join(f"batch {b} {m:.2f}x" for b, m in meds.items()))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"pairs": rows, "median_ratio": meds}, indent=2))


def print_table(r: dict) -> None:
    print(f"\n| measurement ({r['format']}) | jaxserve | llama.cpp | jaxserve / llama.cpp |"
          "\n|---|---|---|---|")

    def row(name: str, a: float, b: float, fmt: str = "{:.1f}", higher: bool = True) -> None:
        ratio = (a / b if higher else b / a) if a and b else float("nan")
        print(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {ratio:.2f}x |")
    for b, d in r["decode"].items():
        row(f"batch {b} decode tok/s", d["jaxserve"]["decode_tok_s"],
            d["llama.cpp"]["decode_tok_s"])
    off = r["offline"]
    row("shared offline workload: output tok/s (llama.cpp: server, all at once)",
        off["jaxserve"]["output_tokens_per_s"], off["llama.cpp"]["output_throughput"])
    via = r["serving"].get("offline_via_server")
    if via:
        row("shared offline workload through each server, all 64 at once: output tok/s",
            via["jaxserve"]["output_throughput"], via["llama.cpp"]["output_throughput"])
    for load, label in (("serve_low", "low load"), ("serve_high", "high load")):
        s = r["serving"].get(load)
        if not s:
            continue
        row(f"serving {label}: mean ITL ms (lower is better)", s["jaxserve"]["mean_itl_ms"],
            s["llama.cpp"]["mean_itl_ms"], higher=False)
        row(f"serving {label}: p50 TTFT ms (lower is better)", s["jaxserve"]["p50_ttft_ms"],
            s["llama.cpp"]["p50_ttft_ms"], higher=False)
        row(f"serving {label}: output tok/s", s["jaxserve"]["output_throughput"],
            s["llama.cpp"]["output_throughput"])
    print("(ratios > 1: jaxserve better)")
    evaluated = {load: d["llama.cpp"].get("prompt_tokens_evaluated")
                 for load, d in r["serving"].items()
                 if isinstance(d.get("llama.cpp"), dict)}
    if evaluated:
        print(f"prompt tokens llama-server evaluated per load (a cached prompt is skipped): "
              f"{evaluated}")
    par = r["serving"].get("parity")
    if par:
        same = len(set(par.values())) == 1
        print(f"greedy completion of the same 64 token ids: {'identical' if same else 'DIFFERENT'}"
              f" ({ {k: v[:60] for k, v in par.items()} })")


def main() -> None:
    global THREADS
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--int8-activations", action="store_true",
                    help="jaxserve with --cpu-int8-activations (4-bit weights: integer dot "
                         "products on int8-quantized inputs, as llama.cpp computes them)")
    ap.add_argument("--format", choices=FORMATS, default="Q4_1",
                    help="the GGUF both engines read (see above)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--low-rate", type=float, default=1.0)
    ap.add_argument("--low-prompts", type=int, default=32)
    ap.add_argument("--high-rate", type=float, default=4.0)
    ap.add_argument("--high-prompts", type=int, default=64)
    ap.add_argument("--llama-slots", type=int, default=16)
    ap.add_argument("--port", type=int, default=8131, help="jaxserve; llama-server: +1")
    ap.add_argument("--serve-time-limit", type=float, default=600.0,
                    help="seconds one load run may take")
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="llama.cpp threads; its spinning thread pool collapses when the "
                         "cores are shared with other jobs: run on a quiet machine")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--offline-pairs", type=int, default=0, metavar="N",
                    help="only the offline workload: N adjacent jaxserve/llama.cpp pairs")
    ap.add_argument("--decode-pairs", type=int, default=0, metavar="N",
                    help="only the decode rows (--batch-sizes): N adjacent pairs")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    THREADS = harness.THREADS = ns.threads    # llama-batched-bench reads harness's
    if ns.offline_pairs:
        return offline_pairs(ns)
    if ns.decode_pairs:
        return decode_pairs(ns)
    ns.parity_prompt = shared_offline(49152).prompts[0][:64]
    bins = harness.build()
    llm, gguf = engine_and_file(ns.format, ns.int8_activations)
    work = harness.cache_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"threads": THREADS, "format": ns.format, "gguf": str(gguf),
                           "args": vars(ns)}
    res["decode"] = {b: {"jaxserve": jaxserve_decode(llm, b, ns.input_len, ns.output_len,
                                                     ns.num_iters)}
                     for b in ns.batch_sizes}
    lc = llamacpp_decode(bins, gguf, ns.batch_sizes, ns.input_len, ns.output_len)
    for b in ns.batch_sizes:
        res["decode"][b]["llama.cpp"] = lc[b]
    res["offline"] = {"jaxserve": run_throughput(llm, shared_offline(
        llm.model_config.vocab_size))}
    del llm                    # free the in-process engine before the servers start
    res["serving"] = {} if ns.skip_serving else run_servers(ns, bins, gguf, work)
    res["offline"]["llama.cpp"] = res["serving"].get("offline_via_server", {}).get(
        "llama.cpp", {"output_throughput": float("nan")})
    print_table(res)
    out = Path(ns.json) if ns.json else work / "results.json"
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
