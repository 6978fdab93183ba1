"""`jaxserve bench serve`: online benchmark of a running server (vLLM's benchmark_serving).

Requests arrive as a seeded Poisson process at each --request-rate (or as fast as
--concurrency allows), stream from /v1/completions, and are timed on the client:

    TTFT   send -> first streamed token          ITL   every gap between token chunks
    TPOT   (latency - TTFT) / (output_len - 1)   E2EL  send -> last byte
    goodput  requests/s meeting every --goodput SLO (e.g. ttft:500 tpot:50, in ms)

Prints a table, writes JSON (--output-json) and, with several rates, a PNG of latency
against request rate (--plot).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.bench.workload import shared_offline
from jaxserve.cli_args import HelpFormatter
from jaxserve.deps import require


@dataclass(slots=True)
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_serve_bench_parser(bsub: Any) -> argparse.ArgumentParser:
    p = bsub.add_parser("serve", help="online benchmark against a running server",
                        formatter_class=HelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--api-key", default=None)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="Poisson arrival rate(s) in requests/s; inf = all at once")
    p.add_argument("--concurrency", type=int, default=None,
                   help="max requests in flight (alone: closed loop at this concurrency)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--workload", choices=("shared", "random"), default="shared")
    p.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random workload: lengths uniform in len*(1 +- ratio)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: from /v1/models")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="POST /reset_prefix_cache before each rate, so every rate starts with "
                        "a cold cache (the same prompts are sent at each rate)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path (latency vs rate)")
    p.set_defaults(fn=main)
    return p


def make_prompts(ns: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    if ns.workload == "shared":
        wl = shared_offline(vocab, num_prompts=ns.num_prompts, output_len=ns.output_len,
                            seed=ns.seed)
        return [(p, wl.output_len) for p in wl.prompts]
    rng = random.Random(ns.seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - ns.range_ratio)), int(n * (1 + ns.range_ratio))))
    return [([rng.randrange(3, vocab) for _ in range(length(ns.input_len))],
             length(ns.output_len)) for _ in range(ns.num_prompts)]


async def timed_stream(client: Any, url: str, body: dict, prompt_len: int,
                       timeout: float) -> Result:
    """One streamed request: its TTFT, inter-token gaps and errors as a Result."""
    res = Result(False, prompt_len)
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"].get("message"))
                    return res
                now = time.perf_counter()
                if any(c.get("text") for c in ev.get("choices", [])):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if ev.get("usage"):
                    res.output_len = ev["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - t0
        res.ok = res.output_len > 0
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_rate(ns: argparse.Namespace, prompts: list[tuple[list[int], int]],
                   model: str, rate: float) -> tuple[list[Result], float]:
    httpx = require("httpx", extra="bench", feature="jaxserve bench serve")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    sem = asyncio.Semaphore(ns.concurrency) if ns.concurrency else None
    rng = np.random.default_rng(ns.seed)
    url = f"{ns.url.rstrip('/')}/v1/completions"
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=ns.timeout) as client:
        async def go(p: list[int], out_len: int) -> Result:
            body = {"model": model, "prompt": p, "max_tokens": out_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            if sem is None:
                return await timed_stream(client, url, body, len(p), ns.timeout)
            async with sem:
                return await timed_stream(client, url, body, len(p), ns.timeout)
        tasks = []
        t0 = time.perf_counter()
        for p, out_len in prompts:
            tasks.append(asyncio.ensure_future(go(p, out_len)))
            if rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize(results: list[Result], duration: float, percentiles: list[float],
              slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out = sum(r.output_len for r in ok)
    s: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out / duration,
        "total_token_throughput": (out + sum(r.prompt_len for r in ok)) / duration,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots,
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name, xs in series.items():
        arr = np.asarray(xs, dtype=float) * 1000.0 if xs else np.zeros(1)
        s[f"mean_{name}_ms"] = float(arr.mean())
        for q in percentiles:
            s[f"p{q:g}_{name}_ms"] = float(np.percentile(arr, q))
    if slos:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0
            vals = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            good += all(vals[k] * 1000.0 <= v for k, v in slos.items())
        s["goodput"] = good / duration
    return s


def _parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for it in items:
        k, _, v = it.partition(":")
        if k not in ("ttft", "tpot", "e2el") or not v:
            raise ValueError(f"--goodput: expected ttft|tpot|e2el:MS, got {it!r}")
        slos[k] = float(v)
    return slos


def _server_info(ns: argparse.Namespace) -> tuple[str, int]:
    httpx = require("httpx", extra="bench", feature="jaxserve bench serve")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    data = httpx.get(f"{ns.url.rstrip('/')}/v1/models", headers=headers, timeout=30).json()
    m = data["data"][0]
    return ns.model or m["id"], ns.vocab_size or int(m.get("vocab_size") or 49152)


def _reset_prefix_cache(ns: argparse.Namespace) -> None:
    httpx = require("httpx", extra="bench", feature="jaxserve bench serve")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    r = httpx.post(f"{ns.url.rstrip('/')}/reset_prefix_cache", headers=headers, timeout=60)
    if r.status_code != 200 or not r.json().get("success", False):
        print(f"warning: could not reset the prefix cache ({r.status_code}; start the server "
              "with --enable-admin-routes): the rates that follow the first may hit the cache")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    matplotlib = require("matplotlib", extra="bench", feature="plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = [r["request_rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, name in zip(axes, ("ttft", "tpot", "e2el")):
        for stat in ("p50", "p99"):
            ax.plot(rates, [r[f"{stat}_{name}_ms"] for r in rows], marker="o", label=stat)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(ns: argparse.Namespace) -> int:
    slos = _parse_slos(ns.goodput)
    pcts = [float(x) for x in ns.percentiles.split(",")]
    model, vocab = _server_info(ns)
    prompts = make_prompts(ns, vocab)
    rates = ns.request_rate or [float("inf")]
    rows = []
    logging.getLogger("httpx").setLevel(logging.WARNING)    # one line per request otherwise
    for rate in rates:
        if ns.reset_prefix_cache:
            _reset_prefix_cache(ns)
        results, duration = asyncio.run(run_rate(ns, prompts, model, rate))
        row = {"request_rate": rate, "concurrency": ns.concurrency, "workload": ns.workload,
               **summarize(results, duration, pcts, slos)}
        rows.append(row)
        print(f"--- request rate {rate:g} req/s, concurrency {ns.concurrency or 'unbounded'} ---")
        for k, v in row.items():
            if k not in ("request_rate", "concurrency", "workload"):
                print(f"{k:>28}: {v:.2f}" if isinstance(v, float) else f"{k:>28}: {v}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"model": model, "url": ns.url, "slos_ms": slos, "runs": rows}, f,
                      indent=2, default=str)
    if ns.plot and len(rows) > 1:
        plot(rows, ns.plot)
    return 0 if all(r["failed"] == 0 for r in rows) else 1
