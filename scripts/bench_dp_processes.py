"""Data-parallel replicas as threads (one process) vs as processes behind the router,
side by side (issue 18 item 3).

    python scripts/bench_dp_processes.py [--dp 2] [--num-prompts 32] [--out runs/bench_dp]

Each setup: `jaxserve serve --data-parallel-size DP` (threads: DP simulated CPU devices in
one process; processes: DP children of one device each, behind the router), then
`jaxserve bench serve` (random prompts, all at once), then the server is stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_vs_llamacpp import PY, Server  # noqa: E402  (a sibling script)
from bench_pd import _port  # noqa: E402

ENGINE = ["--max-model-len", "512", "--max-num-batched-tokens", "256", "--max-num-seqs",
          "16", "--token-buckets", "16", "64", "256"]


def run(backend: str, ns: argparse.Namespace) -> dict:
    port = _port()
    cmd = [PY, "-m", "jaxserve.cli", "serve", "--port", str(port), "--data-parallel-size",
           str(ns.dp), "--data-parallel-backend", backend, *ENGINE]
    if backend == "processes":
        cmd += ["--data-parallel-routing", "least_load"]
    env_flag = f"--xla_force_host_platform_device_count={ns.dp}" if backend == "threads" else ""
    old = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = env_flag
    try:
        srv = Server(cmd, port, Path(ns.out, f"serve_{backend}.log"), ready_timeout=1800)
    finally:
        if old is None:
            os.environ.pop("XLA_FLAGS")
        else:
            os.environ["XLA_FLAGS"] = old
    out = Path(ns.out, f"bench_{backend}.json")
    try:
        subprocess.run([PY, "-m", "jaxserve.cli", "bench", "serve", "--url", srv.url,
                        "--request-rate", "inf", "--num-prompts", str(ns.num_prompts),
                        "--workload", "random", "--input-len", "128", "--output-len", "32",
                        "--no-reset-prefix-cache", "--output-json", str(out)],
                       check=True, timeout=1800)
    finally:
        srv.stop()
    return {"backend": backend, **json.loads(out.read_text())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--out", default="runs/bench_dp")
    ns = p.parse_args()
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    rows = [run(b, ns) for b in ("threads", "processes")]
    Path(ns.out, "results.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(json.dumps(r)[:1500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
