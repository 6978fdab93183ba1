"""Checks and profilers that tests, CI and the README run, each `python -m
jaxserve.tools.<name>` or `jaxserve tools <name> ...`: export_check (accelerator lowering
from a CPU host), device_check (kernels and the engine step on an accelerator), stress
(the reliability suite behind `make stress`), bench_startup, profile_step, profile_steps,
profile_layer, trace_step and kernel_model (an analytic memory model of the
attention kernels).

stress_server is deliberately not in TOOLS: its fault hooks (an engine-thread kill switch,
a wedging token) must stay out of reach of the `jaxserve` command; only the stress suite
starts it, by module.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

TOOLS = {"export-check": "export_check", "device-check": "device_check", "stress": "stress",
         "bench-startup": "bench_startup", "profile-step": "profile_step",
         "profile-steps": "profile_steps", "profile-layer": "profile_layer",
         "trace-step": "trace_step", "kernel-model": "kernel_model"}


def add_tools_parser(sub: Any) -> None:
    p = sub.add_parser("tools", help="checks and profilers (each also python -m "
                                     "jaxserve.tools.<name>)",
                       description="Run one of the developer tools with its own flags, e.g. "
                                   "`jaxserve tools export-check --help`.")
    p.add_argument("tool", choices=sorted(TOOLS))
    p.add_argument("tool_args", nargs=argparse.REMAINDER, help="the tool's own flags")
    p.set_defaults(fn=run_tool)


def run_tool(ns: argparse.Namespace) -> int:
    # imported only now: export_check must set XLA_FLAGS before anything imports jax
    mod = importlib.import_module(f"{__name__}.{TOOLS[ns.tool]}")
    # some tools parse sys.argv themselves; their usage line names the subcommand
    sys.argv = [f"jaxserve tools {ns.tool}", *ns.tool_args]
    rc = mod.main(ns.tool_args) if "argv" in mod.main.__code__.co_varnames else mod.main()
    return int(rc or 0)
