"""`jaxserve bench {throughput,latency,serve,sweep}`: argument parsing and dispatch."""
from __future__ import annotations

import argparse
from typing import Any, Callable


def add_bench_parsers(sub: Any, engine_parser: Callable[..., argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, serve, sweep)")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)

    p = engine_parser(bsub, "throughput", "offline throughput on the shared workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(fn=_dispatch("throughput"))


def _dispatch(name: str) -> Callable[[argparse.Namespace], int]:
    def fn(ns: argparse.Namespace) -> int:
        from jaxserve.cli import _args
        if name == "throughput":
            from jaxserve.bench.throughput import main
            return main(ns, _args(ns))
        raise ValueError(f"unknown benchmark {name}")
    return fn


def run(ns: argparse.Namespace) -> int:
    return ns.fn(ns)
