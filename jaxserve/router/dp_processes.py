"""`jaxserve serve --data-parallel-size N --data-parallel-backend processes`: N engine
processes behind the router, instead of N replica threads in one process (whose host
work shares one GIL).

    this process (no jax)                        N children, one `jaxserve serve` each
      jaxserve router on --host:--port  --HTTP-->  127.0.0.1:<free port>,
      policy --data-parallel-routing               --data-parallel-size 1, same flags,
      (--api-key for clients and backends)          devices: its own slice (below)

Device slices: child i gets devices [i*T, (i+1)*T) (T = --tensor-parallel-size): on a
GPU host through CUDA_VISIBLE_DEVICES; on a TPU host through the TPU runtime's
per-process variables (tpu_env: its chips, their bounds, a slice of its own); on CPU,
T simulated devices each.

A child that dies is taken out of the router and restarted, a bounded number of times
with backoff (dp_supervisor.py), and so is one that is not healthy
--replica-start-timeout s after its start (killed: SIGTERM, then SIGKILL); SIGTERM
stops the router, then the children (each drains its own requests for
--shutdown-timeout s).

With --kv-transfer-config (disaggregated prefill/decode) each child is a producer or
consumer of its own: its own transfer endpoint, advertised at this server's --host (or
kv_ip) on kv_port + i (kv_port 0: any free port), so the kv_transfer_params a prefill
response carries name the child that holds the KV; a consumer child pulls for the
requests the router hands it, params and all.

Not the default: on a 2-core CPU host the in-process threads served the shared workload
about 2x faster (docs/benchmarks.md, "Data parallel: threads vs processes").
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from jaxserve.config import EngineArgs
from jaxserve.router.dp_supervisor import Replica, RestartPolicy, Supervisor

log = logging.getLogger("jaxserve")

# fields the parent sets per child (or keeps for itself)
_OWN = {"model", "data_parallel_size", "data_parallel_backend", "data_parallel_routing",
        "host", "port", "replica_start_timeout"}
_ANY_ADDRESS = ("0.0.0.0", "::", "")


def child_argv(args: EngineArgs, port: int, index: int = 0) -> list[str]:
    """`jaxserve serve` flags that rebuild args as replica `index` on 127.0.0.1:port."""
    argv = [sys.executable, "-m", "jaxserve.cli", "serve"]
    if args.model is not None:
        argv.append(args.model)
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name in _OWN or value == getattr(defaults, f.name):
            continue
        if f.name == "kv_transfer_config":
            value = child_kv_config(args, index)
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


def _kv_dict(args: EngineArgs) -> dict[str, Any]:
    text = args.kv_transfer_config
    return dict(json.loads(text) if isinstance(text, str) else text or {})


def child_kv_config(args: EngineArgs, index: int) -> str:
    """Replica `index`'s --kv-transfer-config: its own transfer endpoint. A child serves
    HTTP on 127.0.0.1, but decode servers elsewhere must reach a producer child's KV, so
    it binds and advertises this server's address (kv_ip, else --host); a fixed kv_port
    becomes kv_port + index (firewall rules then name a range), 0 stays any free port."""
    cfg = _kv_dict(args)
    if cfg.get("kv_role") in ("kv_producer", "kv_both"):
        cfg["kv_ip"] = cfg.get("kv_ip") or args.host
    if cfg.get("kv_port"):
        cfg["kv_port"] = int(cfg["kv_port"]) + index
    return json.dumps(cfg)


def check_kv_transfer(args: EngineArgs) -> None:
    """Refuse at start-up what would only fail in the children."""
    if not args.kv_transfer_config:
        return
    cfg = _kv_dict(args)
    if (cfg.get("kv_role") in ("kv_producer", "kv_both") and not cfg.get("kv_ip")
            and args.host in _ANY_ADDRESS):
        raise ValueError(f"--kv-transfer-config: a kv_producer serving on --host "
                         f"{args.host!r} needs kv_ip, the address decode servers reach "
                         f"its replicas at")
    last = int(cfg.get("kv_port") or 0) + args.data_parallel_size - 1
    if cfg.get("kv_port") and last > 65535:
        raise ValueError(f"--kv-transfer-config: replica i uses kv_port + i; kv_port "
                         f"{cfg['kv_port']} + {args.data_parallel_size - 1} is past 65535")


def child_env(index: int, tp: int, platform: str, *, tpu_port: int = 8476
              ) -> dict[str, str]:
    """The environment of child `index`: this one plus its device slice."""
    env = dict(os.environ)
    if platform == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index * tp + d) for d in range(tp))
    elif platform == "tpu":
        env.update(tpu_env(index, tp, tpu_port))
    else:
        # exactly its T devices, whatever device count this process was started with
        flags = env.get("XLA_FLAGS", "").split()
        flags = [x for x in flags if not x.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={tp}"])
        env.setdefault("PJRT_NPROC", str(cpu_collective_threads(tp)))
    return env


def cpu_collective_threads(devices: int) -> int:
    """Threads for XLA:CPU's intra-op pool (PJRT_NPROC) in a process of `devices`
    simulated CPU devices. The pool is sized by the core count, and every device's
    program runs its concurrent thunks on it; a collective blocks its thread until all
    devices arrive. With fewer threads than blocked participants (8 devices on 2 cores,
    each device able to hold more than one collective in flight), the devices that have
    not arrived never get a thread and XLA aborts the process after its timeout."""
    return max(2 * devices, os.cpu_count() or 1)


# Chips per replica -> their bounds (x,y,z) on the host's chip grid: the sub-host shapes
# the TPU runtime accepts (those Ray and vLLM's TPU data-parallel example set).
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


def tpu_env(index: int, chips: int, port: int) -> dict[str, str]:
    """Variables that make one TPU process see chips [index*chips, (index+1)*chips) of
    this host as a slice of its own (one chip = one JAX device: v4, v5e, v5p, v6e).
    Each process also needs its own runtime port, and libtpu must allow several
    processes on one host (else the second one refuses to load)."""
    if chips not in TPU_CHIP_BOUNDS:
        raise ValueError(f"--data-parallel-backend processes on TPU: each replica needs "
                         f"1, 2, 4 or 8 chips (--tensor-parallel-size), got {chips}")
    visible = ",".join(str(index * chips + c) for c in range(chips))
    return {
        "TPU_VISIBLE_CHIPS": visible,
        "TPU_VISIBLE_DEVICES": visible,     # the older name of the same setting
        "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_CHIP_BOUNDS[chips],
        "TPU_PROCESS_BOUNDS": "1,1,1",      # one process in its slice: no peers to meet
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
        "TPU_PROCESS_PORT": str(port),
        "CLOUD_TPU_TASK_ID": "0",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }


def _check_tpu_chips(needed: int) -> None:
    """Refuse a split the host cannot hold, when its chips can be counted without jax."""
    found = len(glob.glob("/dev/accel*")) or len(glob.glob("/dev/vfio/[0-9]*"))
    if found and needed > found:
        raise ValueError(f"--data-parallel-size x --tensor-parallel-size = {needed} TPU "
                         f"chips, but this host has {found}")


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
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if platform == "tpu":
        _check_tpu_chips(dp * tp)
    check_kv_transfer(args)
    ports = _free_ports(2 * dp)         # an HTTP port and a TPU runtime port each
    replicas = [Replica(i, f"http://127.0.0.1:{ports[i]}", child_argv(args, ports[i], i),
                        child_env(i, tp, platform, tpu_port=ports[dp + i]))
                for i in range(dp)]
    supervisor = Supervisor(replicas, spawn=_spawn, policy=RestartPolicy(
        start_timeout_s=args.replica_start_timeout))
    try:
        supervisor.start_all()
        urls = [r.url for r in replicas]
        try:
            wait_started(supervisor, args.api_key)
        except RuntimeError as e:
            log.error("data parallel: %s; stopping", e)
            return 1
        from jaxserve.router import RouterConfig, run_router
        return run_router(RouterConfig(
            backends=urls, policy=args.data_parallel_routing, host=args.host,
            port=args.port, api_key=args.api_key, backend_api_key=args.api_key,
            public_metrics=args.public_metrics, limit_concurrency=args.limit_concurrency,
            max_request_body_bytes=args.max_request_body_bytes,
            watchers=[supervisor.watch]))
    finally:
        _stop(supervisor.processes(), args.shutdown_timeout + 10)


def _spawn(r: Replica) -> subprocess.Popen:
    return subprocess.Popen(r.argv, env=r.env, preexec_fn=_die_with_parent)


@dataclass(slots=True)
class _Probe:
    url: str
    healthy: bool = False


@dataclass(slots=True)
class _StartPool:
    """The backend pool the supervisor ticks with before the router exists."""
    backends: list[_Probe]

    def mark_down(self, b: _Probe, reason: str) -> None:
        b.healthy = False


def wait_started(sup: Supervisor, key: str | None) -> None:
    """Block until every replica answers /health with 200 or is given up on. A start
    that hangs past the deadline is stopped and started again (the supervisor's rules);
    a replica that exits by itself while starting stops everything: every replica runs
    the same flags, so that is a configuration error (its log says which)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    pool = _StartPool([_Probe(r.url) for r in sup.replicas])
    while not all(r.given_up or r.up_since is not None for r in sup.replicas):
        for r, b in zip(sup.replicas, pool.backends):
            b.healthy = (r.proc is not None and r.proc.poll() is None
                         and _answers(r.url, headers))
        before = [(r.proc, r.hung_since is None) for r in sup.replicas]
        sup.tick(pool)
        for r, (proc, by_itself) in zip(sup.replicas, before):
            if by_itself and proc is not None and r.proc is not proc:    # it ended
                raise RuntimeError(f"data-parallel replica {r.index} exited with status "
                                   f"{proc.poll()} while starting")
        time.sleep(sup.policy.poll_s)
    up = [r.url for r in sup.replicas if not r.given_up]
    if not up:
        raise RuntimeError("no data-parallel replica became healthy (see the log above)")
    log.info("data parallel: %d replica processes up: %s", len(up), ", ".join(up))


def _answers(url: str, headers: dict[str, str]) -> bool:
    import httpx
    try:
        return httpx.get(f"{url}/health", headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


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


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (all held open while choosing, so none repeats). A restarted
    replica binds its port again (the server sets SO_REUSEADDR)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()

