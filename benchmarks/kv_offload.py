#!/usr/bin/env python
"""KV offload tiers on a multi-turn chat workload, side by side in one run.

C conversations x K turns over HTTP (/v1/chat/completions, streamed, greedy, EOS
ignored): each conversation sends its whole history (its own system prompt, a document
of --system-words words, then its user and assistant messages) with a new user
message, waits for the reply, thinks for a random 0..T s, and sends the next turn; all
conversations run at once. The server's device KV pool is small (--num-kv-blocks), so
conversations evict each other's blocks long before their next turn. One server per setup, each started on loopback and stopped
by its PID:

    off          prefix cache on the device only
    host         + --kv-offload-bytes (large enough for every conversation)
    host+disk    + a small host tier and --kv-offload-dir (a fresh directory)
    restart      host+disk again on the same directory after a stop: every turn, the
                 first one included, can find its prefix there

Reported per setup: TTFT p50 / p99 and the prompt tokens the server computed (its
usage's prompt_tokens minus prompt_tokens_details.cached_tokens, summed), and ratios
against `off`. `--throughput` adds a pair of servers with a pool that holds the whole
workload (nothing evicted) and no think time (the server saturated): output tokens/s
with the offload tiers off and on, the tiers' cost when they have nothing to do.

    .venv/bin/python -m benchmarks.kv_offload [--throughput] [--convs 16 --turns 6]
        [--json out.json]
    .venv/bin/python -m benchmarks.kv_offload --overhead    # in-process cost check

The defaults keep one run within about ten minutes on two CPU cores with the embedded
model: the think time keeps the server below saturation, so TTFT measures the prefill
a turn pays rather than the queue in front of it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import PY, Server, free_port

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "gu"]


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
                    for _ in range(n))


async def turn(client: Any, url: str, messages: list[dict], out_len: int
               ) -> tuple[float, str, int, int]:
    """One streamed turn -> (ttft s, reply text, prompt tokens, cached prompt tokens)."""
    body = {"model": "default", "messages": messages, "max_tokens": out_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = 0.0, [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(piece)
            usage = ev.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, "".join(text), usage.get("prompt_tokens", 0), cached


async def workload(url: str, ns: argparse.Namespace) -> dict[str, Any]:
    import httpx
    rng = random.Random(ns.seed)
    systems = [{"role": "system", "content": words(rng, ns.system_words)}
               for _ in range(ns.convs)]
    users = [[words(rng, ns.user_words) for _ in range(ns.turns)] for _ in range(ns.convs)]
    thinks = [[rng.uniform(0, ns.think) for _ in range(ns.turns)] for _ in range(ns.convs)]
    ttfts: list[float] = []
    prompt = cached = out_tokens = 0

    async def conversation(client: Any, c: int) -> None:
        nonlocal prompt, cached, out_tokens
        history = [systems[c]]
        for k in range(ns.turns):
            history.append({"role": "user", "content": users[c][k]})
            ttft, reply, p, hit = await turn(client, url, history, ns.out_len)
            history.append({"role": "assistant", "content": reply})
            ttfts.append(ttft)
            prompt, cached, out_tokens = prompt + p, cached + hit, out_tokens + ns.out_len
            await asyncio.sleep(thinks[c][k])

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=ns.convs + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(conversation(client, c) for c in range(ns.convs)))
    secs = time.perf_counter() - t0
    t = np.array(ttfts)
    return {"requests": len(ttfts), "seconds": secs,
            "ttft_p50_ms": 1e3 * float(np.percentile(t, 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile(t, 99)),
            "prompt_tokens": prompt, "prefilled_tokens": prompt - cached,
            "output_tok_per_s": out_tokens / secs}


def serve(ns: argparse.Namespace, log: Path, blocks: int, extra: list[str]) -> Server:
    port = free_port()
    cmd = [PY, "-m", "jaxserve.cli", "serve", "--port", str(port),
           "--served-model-name", "default", "--num-kv-blocks", str(blocks),
           "--max-model-len", str(ns.max_model_len), "--max-num-seqs", str(ns.max_num_seqs),
           "--enable-prompt-tokens-details", *extra]
    if ns.model:
        cmd += ["--model", ns.model]
    return Server(cmd, port, log, ready_timeout=900)


def run_setup(ns: argparse.Namespace, name: str, blocks: int, extra: list[str],
              logs: Path) -> dict[str, Any]:
    server = serve(ns, logs / f"{name}.log", blocks, extra)
    try:
        row = {"setup": name, **asyncio.run(workload(server.url, ns))}
    finally:
        server.stop()
    print(json.dumps(row), flush=True)
    return row


def overhead(ns: argparse.Namespace) -> None:
    """In one process, interleaved rounds: an engine without the tiers and one with
    host + disk tiers, a pool that holds everything (nothing is evicted), 16 prompts x
    64 tokens out per round. Output tokens/s per round and the median ratio."""
    from jaxserve import LLM, SamplingParams
    rng = random.Random(ns.seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(200)] for _ in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    tmp = Path(tempfile.mkdtemp(prefix="kv_offload_overhead_"))
    common = dict(model=ns.model, num_kv_blocks=1024, max_model_len=ns.max_model_len,
                  max_num_seqs=16)
    engines = {"off": LLM(**common),
               "host+disk": LLM(**common, kv_offload_bytes=ns.small_host_bytes,
                                kv_offload_dir=str(tmp / "kv"))}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for rnd in range(ns.overhead_rounds):
        for name, llm in engines.items():
            batch = [[rnd] + p for p in prompts]        # a new prefix every round
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": b} for b in batch], params, use_tqdm=False)
            rates[name].append(16 * 64 / (time.perf_counter() - t0))
            print(name, f"{rates[name][-1]:.1f} tok/s", flush=True)
    ratios = [b / a for a, b in zip(rates["off"], rates["host+disk"])]
    print(f"output tok/s, median of {ns.overhead_rounds} rounds: off "
          f"{float(np.median(rates['off'])):.1f}, host+disk "
          f"{float(np.median(rates['host+disk'])):.1f}; on/off per round "
          f"{[round(r, 3) for r in ratios]}, median {float(np.median(ratios)):.3f}")
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--think", type=float, default=12.0, help="most think time (s)")
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--user-words", type=int, default=12)
    ap.add_argument("--out-len", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--host-bytes", type=int, default=2 << 30)
    ap.add_argument("--small-host-bytes", type=int, default=64 << 20)
    ap.add_argument("--disk-bytes", type=int, default=4 << 30)
    ap.add_argument("--throughput", action="store_true",
                    help="also: a pool that holds everything, offload off vs on")
    ap.add_argument("--overhead", action="store_true",
                    help="only the in-process cost check (no servers): see overhead()")
    ap.add_argument("--overhead-rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    if ns.overhead:
        return overhead(ns)
    logs = Path(tempfile.mkdtemp(prefix="kv_offload_bench_"))
    disk = logs / "kv"
    host = ["--kv-offload-bytes", str(ns.host_bytes)]
    both = ["--kv-offload-bytes", str(ns.small_host_bytes), "--kv-offload-dir", str(disk),
            "--kv-offload-dir-bytes", str(ns.disk_bytes)]
    rows = [run_setup(ns, "off", ns.num_kv_blocks, [], logs),
            run_setup(ns, "host", ns.num_kv_blocks, host, logs),
            run_setup(ns, "host+disk", ns.num_kv_blocks, both, logs),
            run_setup(ns, "restart", ns.num_kv_blocks, both, logs)]
    if ns.throughput:     # no think time: the server saturated, output tok/s compared
        big = ns.convs * -(-ns.max_model_len // 16)     # every history at its longest
        busy = argparse.Namespace(**{**vars(ns), "think": 0.0})
        rows += [run_setup(busy, "big pool, off, busy", big, [], logs),
                 run_setup(busy, "big pool, host+disk, busy", big,
                           both[:-4] + ["--kv-offload-dir", str(logs / "kv2")], logs)]
    base = rows[0]
    print(f"\n{'setup':<28}{'TTFT p50 ms':>12}{'p99 ms':>10}{'prefilled':>11}"
          f"{'x fewer':>9}{'p50 x':>8}{'out tok/s':>11}")
    for r in rows:
        print(f"{r['setup']:<28}{r['ttft_p50_ms']:>12.1f}{r['ttft_p99_ms']:>10.1f}"
              f"{r['prefilled_tokens']:>11d}"
              f"{base['prefilled_tokens'] / max(1, r['prefilled_tokens']):>9.2f}"
              f"{base['ttft_p50_ms'] / r['ttft_p50_ms']:>8.2f}{r['output_tok_per_s']:>11.1f}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))
    shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()
