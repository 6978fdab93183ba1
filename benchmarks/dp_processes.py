"""Data-parallel replicas as threads (one process) vs as processes behind the router,
side by side, like for like.

    python -m benchmarks.dp_processes [--dp 2 4] [--rounds 2] [--num-prompts 64] \\
        [--out runs/bench_dp]

Both arms start from the same environment, 8 simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8): threads use DP of them in one
process; processes give each child exactly one (dp_processes.child_env). Both arms take
the same single-device paths (the C++ CPU attention and matmul kernels, asynchronous
scheduling: a one-device plan splits nothing); the engine's own start-up line says which
attention each used, and the table shows it. Each run: `jaxserve serve
--data-parallel-size DP --data-parallel-backend B`, then `jaxserve bench serve
--workload shared` (jaxserve.bench.workload's shared workload, all at once), then the server is
stopped. The arms alternate (threads, processes, threads, processes, ...) so a drift in
the machine's load falls on both; the load average is recorded around each run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .harness import PY, Server, free_port

ENGINE = ["--max-model-len", "512", "--max-num-batched-tokens", "256", "--max-num-seqs",
          "16", "--token-buckets", "16", "64", "256"]
DEVICES = "--xla_force_host_platform_device_count=8"
KEYS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p50_itl_ms",
        "p99_itl_ms", "completed", "failed", "duration_s")


def run(backend: str, dp: int, tag: str, ns: argparse.Namespace) -> dict:
    port = free_port()
    cmd = [PY, "-m", "jaxserve.cli", "serve", "--port", str(port), "--data-parallel-size",
           str(dp), "--data-parallel-backend", backend, *ENGINE]
    if backend == "processes":
        cmd += ["--data-parallel-routing", "least_load"]
    old = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = DEVICES          # the same start for both arms
    log = Path(ns.out, f"serve_{tag}.log")
    try:
        srv = Server(cmd, port, log, ready_timeout=1800)
    finally:
        if old is None:
            os.environ.pop("XLA_FLAGS")
        else:
            os.environ["XLA_FLAGS"] = old
    out = Path(ns.out, f"bench_{tag}.json")
    load_before = os.getloadavg()[0]
    try:
        subprocess.run([PY, "-m", "jaxserve.cli", "bench", "serve", "--url", srv.url,
                        "--request-rate", "inf", "--num-prompts", str(ns.num_prompts),
                        "--workload", "shared", "--no-reset-prefix-cache",
                        "--output-json", str(out)], check=True, timeout=3600)
    finally:
        load_after = os.getloadavg()[0]
        srv.stop()
    result = json.loads(out.read_text())["runs"][0]
    return {"backend": backend, "dp": dp, "tag": tag,
            "attention": sorted(set(re.findall(r"attention=(\w+)", log.read_text()))),
            "load_before": load_before, "load_after": load_after,
            **{k: result.get(k) for k in KEYS}}


def table(rows: list[dict]) -> str:
    head = ("| DP | backend | round | attention | output tok/s | TTFT p50 ms | TTFT p99 ms "
            "| TPOT p50 ms | ITL p50 ms | ITL p99 ms | load avg (1 min) before / after |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['dp']} | {r['backend']} | {r['tag'].rsplit('_', 1)[1]} | "
            f"{'/'.join(r['attention'])} | {r['output_throughput']:.1f} | "
            f"{r['p50_ttft_ms']:,.0f} | {r['p99_ttft_ms']:,.0f} | {r['p50_tpot_ms']:,.0f} | "
            f"{r['p50_itl_ms']:,.0f} | {r['p99_itl_ms']:,.0f} | "
            f"{r['load_before']:.1f} / {r['load_after']:.1f} |")
    return "\n".join(lines).replace(",", " ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[2])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--out", default="runs/bench_dp")
    ns = p.parse_args()
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for dp in ns.dp:
        for i in range(ns.rounds):
            for backend in ("threads", "processes"):
                rows.append(run(backend, dp, f"dp{dp}_{backend}_{i}", ns))
                Path(ns.out, "results.json").write_text(json.dumps(rows, indent=1))
                print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
