"""Disaggregated prefill/decode vs co-located serving on the same cores.

    python -m benchmarks.pd [--rounds 1] [--out runs/bench_pd]

Two setups, each behind a `jaxserve router` (so both pay the same proxy hop):
  co-located  one `jaxserve serve` pinned to cores 0,1 (taskset), --policy round_robin
  P/D         a kv_producer pinned to core 0 and a kv_consumer pinned to core 1,
              --policy pd
One workload, mixed, open loop: class (b) short prompts / long outputs stream
continuously while class (a) long prompts / short outputs arrive every --a-gap s.
Reported per class: TTFT and ITL p50/p99 (ms). Then the KV transfer itself on loopback,
in this process with the served model's geometry: latency of pulling n blocks (gather on
the producer, TCP, scatter on the consumer) and the bandwidth it reaches.
The router and this client run unpinned on the same 2 cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.bench.serve import Result, timed_stream

from .harness import PY, KVPullRig, Server, free_port

ENGINE = ["--max-model-len", "1024", "--max-num-batched-tokens", "256", "--max-num-seqs",
          "16", "--token-buckets", "16", "64", "256"]
VOCAB = 49152


def _serve(cores: str, port: int, log: Path, kv: dict | None) -> Server:
    cmd = ["taskset", "-c", cores, PY, "-m", "jaxserve.cli", "serve", "--port", str(port),
           *ENGINE]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return Server(cmd, port, log, ready_timeout=900)


def _router(port: int, log: Path, policy: list[str]) -> Server:
    return Server([PY, "-m", "jaxserve.cli", "router", "--port", str(port), *policy],
                  port, log, ready_timeout=120)


def workload(ns: argparse.Namespace) -> list[tuple[float, str, list[int], int]]:
    """(start offset s, class, prompt ids, max_tokens), seeded."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    out = [(i * ns.b_gap, "b", ids(ns.b_prompt), ns.b_out) for i in range(ns.num_b)]
    out += [(0.5 + i * ns.a_gap, "a", ids(ns.a_prompt), ns.a_out) for i in range(ns.num_a)]
    return sorted(out, key=lambda x: x[0])


async def run_load(url: str, work: list[tuple[float, str, list[int], int]]
                   ) -> dict[str, list[Result]]:
    import httpx
    out: dict[str, list[Result]] = {"a": [], "b": []}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        async def go(at: float, cls: str, prompt: list[int], n: int) -> None:
            await asyncio.sleep(at)
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": n,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            out[cls].append(await timed_stream(c, f"{url}/v1/completions", body, len(prompt), 600))
        # warm the path with one request of each class's shape (first-use work such as
        # the CPU kernel's build lands here, not in the numbers); ids unlike the
        # workload's, so no prefix hits
        warm = [(0.0, c, [3 + (i % 50) for i in range(len(p))], n)
                for c, p, n in {w[1]: (w[1], w[2], w[3]) for w in work}.values()]
        for w in warm:
            await go(*w)
        out["a"].clear()
        out["b"].clear()
        await asyncio.gather(*(go(*w) for w in work))
    return out


def summarize(res: dict[str, list[Result]]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for cls, rs in res.items():
        ok = [r for r in rs if r.ok]
        s[f"{cls}_failed"] = len(rs) - len(ok)
        ttft = np.array([r.ttft for r in ok]) * 1e3
        itl = np.array([x for r in ok for x in r.itl]) * 1e3
        for name, arr in (("ttft", ttft), ("itl", itl)):
            for q in (50, 99):
                s[f"{cls}_{name}_p{q}"] = float(np.percentile(arr, q)) if arr.size else None
    return s


def run_setup(name: str, ns: argparse.Namespace, work: list) -> dict[str, Any]:
    out = Path(ns.out)
    servers: list[Server] = []
    try:
        if name == "colocated":
            s = _serve("0,1", free_port(), out / "colo.log", None)
            servers.append(s)
            policy = ["--policy", "round_robin", "--backend", s.url]
        else:       # both start (compile) at once, each on its own core
            with ThreadPoolExecutor(2) as ex:
                fp = ex.submit(_serve, "0", free_port(), out / "prefill.log",
                               {"kv_role": "kv_producer"})
                fd = ex.submit(_serve, "1", free_port(), out / "decode.log",
                               {"kv_role": "kv_consumer"})
                for f in (fp, fd):
                    if f.exception() is None:
                        servers.append(f.result())
                p, d = fp.result(), fd.result()
            policy = ["--policy", "pd", "--prefill", p.url, "--decode", d.url]
        r = _router(free_port(), out / f"router_{name}.log", policy)
        servers.append(r)
        t0 = time.perf_counter()
        res = asyncio.run(run_load(r.url, work))
        return {"setup": name, "seconds": time.perf_counter() - t0, **summarize(res)}
    finally:
        for s in reversed(servers):
            s.stop()


def transfer_bench(blocks: list[int], reps: int) -> list[dict[str, Any]]:
    """Pull n blocks of SmolLM2-135M's KV (fp32, block 16) producer -> consumer."""
    rig = KVPullRig(max(blocks) * 2 + 2)
    rows = []
    try:
        for n in blocks:
            t = float(np.median([rig.pull(n) for _ in range(reps)]))
            size = n * rig.bytes_per_block
            rows.append({"blocks": n, "mib": size / 2**20, "ms": t * 1e3,
                         "ms_per_block": t * 1e3 / n, "gb_s": size / t / 1e9})
    finally:
        rig.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_pd")
    p.add_argument("--rounds", type=int, default=1, help="co-located/P-D pairs, alternating")
    p.add_argument("--num-a", type=int, default=6)
    p.add_argument("--a-prompt", type=int, default=768)
    p.add_argument("--a-out", type=int, default=4)
    p.add_argument("--a-gap", type=float, default=2.0)
    p.add_argument("--num-b", type=int, default=6)
    p.add_argument("--b-prompt", type=int, default=32)
    p.add_argument("--b-out", type=int, default=96)
    p.add_argument("--b-gap", type=float, default=0.2)
    p.add_argument("--transfer-blocks", default="1,4,16,48")
    p.add_argument("--skip-serving", action="store_true")
    ns = p.parse_args()
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    rows = []
    if not ns.skip_serving:
        work = workload(ns)
        for _ in range(ns.rounds):
            for name in ("colocated", "pd"):
                rows.append(run_setup(name, ns, work))
                print(json.dumps(rows[-1]), flush=True)
    xfer = transfer_bench([int(x) for x in ns.transfer_blocks.split(",")], reps=5)
    for r in xfer:
        print(json.dumps(r), flush=True)
    Path(ns.out, "results.json").write_text(json.dumps({"serving": rows, "transfer": xfer,
                                                        "args": vars(ns)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
