"""`jaxserve serve --data-parallel-size N --data-parallel-backend processes`: N engine
processes behind the router, instead of N replica threads in one process (whose host
work shares one GIL).

    this process (no jax)                        N children, one `jaxserve serve` each
      jaxserve router on --host:--port  --HTTP-->  127.0.0.1:<free port>,
      policy --data-parallel-routing               --data-parallel-size 1, same flags,
      (--api-key for clients and backends)          devices: its own slice (below)

Device slices: child i gets devices [i*T, (i+1)*T) (T = --tensor-parallel-size): on a
GPU host through CUDA_VISIBLE_DEVICES; on CPU, T simulated devices each. TPU hosts are
refused for now: one process per chip group also needs the TPU_* process-bounds
variables, untested here (use --data-parallel-backend threads there).

A child that dies is taken out by the router's health checks (not restarted: run the
whole under a supervisor); SIGTERM stops the router, then the children (each drains
its own requests for --shutdown-timeout s).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from jaxserve.config import EngineArgs

log = logging.getLogger("jaxserve")

# fields the parent sets per child (or keeps for itself)
_OWN = {"model", "data_parallel_size", "data_parallel_backend", "data_parallel_routing",
        "host", "port"}


def child_argv(args: EngineArgs, port: int) -> list[str]:
    """`jaxserve serve` flags that rebuild args as one replica on 127.0.0.1:port."""
    argv = [sys.executable, "-m", "jaxserve.cli", "serve"]
    if args.model is not None:
        argv.append(args.model)
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name in _OWN or value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv + ["--host", "127.0.0.1", "--port", str(port)]


def child_env(index: int, tp: int, platform: str) -> dict[str, str]:
    env = dict(os.environ)
    if platform == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index * tp + d) for d in range(tp))
    elif tp > 1:
        flags = env.get("XLA_FLAGS", "").split()
        flags = [x for x in flags if not x.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={tp}"])
    return env


def _platform() -> str:
    """Without importing jax here (it would take every GPU's memory in this process)."""
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    if any(importlib.util.find_spec(m) is not None
           for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return "gpu"
    return "cpu"


def serve_replicas(args: EngineArgs) -> int:
    platform = _platform()
    if platform == "tpu":
        raise ValueError("--data-parallel-backend processes is not supported on TPU hosts "
                         "yet; use --data-parallel-backend threads")
    ports = [_free_port() for _ in range(args.data_parallel_size)]
    procs = [subprocess.Popen(child_argv(args, port),
                              env=child_env(i, args.tensor_parallel_size, platform),
                              preexec_fn=_die_with_parent)
             for i, port in enumerate(ports)]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        _wait_healthy(urls, procs, args.api_key)
        from jaxserve.router import RouterConfig, run_router
        return run_router(RouterConfig(
            backends=urls, policy=args.data_parallel_routing, host=args.host,
            port=args.port, api_key=args.api_key, backend_api_key=args.api_key,
            public_metrics=args.public_metrics, limit_concurrency=args.limit_concurrency,
            max_request_body_bytes=args.max_request_body_bytes))
    finally:
        _stop(procs, args.shutdown_timeout + 10)


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen], key: str | None,
                  timeout: float = 3600.0) -> None:
    import httpx
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout
    left = set(range(len(urls)))
    while left:
        for i in sorted(left):
            if procs[i].poll() is not None:
                raise RuntimeError(f"data-parallel replica {i} exited with status "
                                   f"{procs[i].returncode} while starting")
            try:
                if httpx.get(f"{urls[i]}/health", headers=headers, timeout=2).status_code == 200:
                    left.discard(i)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"data-parallel replicas {sorted(left)} not ready in time")
        time.sleep(0.5)
    log.info("data parallel: %d replica processes up: %s", len(urls), ", ".join(urls))


def _stop(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _die_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM if this process dies, even by
    SIGKILL (when our cleanup never runs), so no replica outlives its router."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

