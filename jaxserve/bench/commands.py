"""`jaxserve bench {throughput,latency,serve,sweep}`: argument parsing and dispatch."""
from __future__ import annotations

import argparse
from typing import Any, Callable

from jaxserve.cli_args import HelpFormatter, engine_args, engine_parser


def add_bench_parsers(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, serve, sweep)")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)

    p = engine_parser(bsub, "throughput", "offline throughput on the shared workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(fn=_dispatch("throughput"))

    # -- latency (vLLM's `bench latency`: one fixed batch, end-to-end percentiles) --------
    p = engine_parser(bsub, "latency", "end-to-end latency of one fixed batch (p10..p99)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(fn=_dispatch("latency"))

    # -- serve (Poisson arrivals against a running server; see docs/serving.md) ---------
    from jaxserve.bench.serve import add_serve_bench_parser
    add_serve_bench_parser(bsub)

    # -- sweep (ablation grids from configs/ablations/*.yaml) -----------------------------
    p = bsub.add_parser("sweep", help="run an ablation grid from a YAML file",
                        description="Run an ablation grid: every point a fresh engine on a "
                                    "named, seeded workload; writes results.{json,csv,md} "
                                    "and PNG plots. See docs/ablations.md.",
                        formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, help="ablation YAML (configs/ablations/*.yaml)")
    p.add_argument("--output-dir", default=None, help="default: output_dir from the config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config entry by dotted key, value in YAML, e.g. "
                        "--set workload.num_prompts=16 --set grid.block_size=[16,64]")
    p.add_argument("--dry-run", action="store_true", help="validate and list the points only")
    p.set_defaults(fn=_dispatch("sweep"))


def _dispatch(name: str) -> Callable[[argparse.Namespace], int]:
    def fn(ns: argparse.Namespace) -> int:
        if name == "throughput":
            from jaxserve.bench.throughput import main
            return main(ns, engine_args(ns))
        if name == "latency":
            from jaxserve.bench.latency import main
            return main(ns, engine_args(ns))
        if name == "sweep":
            from jaxserve.bench.sweep import main as sweep_main
            return sweep_main(ns)
        raise ValueError(f"unknown benchmark {name}")
    return fn


def run(ns: argparse.Namespace) -> int:
    return ns.fn(ns)
