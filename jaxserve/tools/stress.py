#!/usr/bin/env python
"""`make stress`: the reliability suite, named cases against real `jaxserve serve` (and
`jaxserve router`) processes on 127.0.0.1 (default model: the embedded
SmolLM2-135M-Instruct). Bounded in time; not part of `make test`
(tests/tools/test_stress_short.py runs a short version of every case).

    .venv/bin/python -m jaxserve.tools.stress [--duration 180] [--concurrency 64]
        [--fuzz-seconds 60] [--storm 800] [--cases NAME ...] [--output-json PATH]

Server A (`python -m jaxserve.cli serve`, an API key, --enable-admin-routes so /admin/kv
shows leaked KV blocks): schema_fuzz, streams_disconnects, every attack, router_unroutable
(a `jaxserve router` in front of it), then sigterm_mid_load, which ends it. A prefill and
a decode server (--kv-transfer-config, a transfer secret of their own): the kv_transfer
cases. Server B (jaxserve/tools/stress_server.py: the same serve path plus a SIGUSR1 kill switch
for the engine thread): engine_killed, which ends it. Server C (jaxserve/tools/stress_server.py
with a token id that wedges the engine thread, --step-timeout 2): engine_wedged, which
ends it. Every attack, the router, kv_transfer and wedge cases run with a victim stream
and /health probes (stress_lib.Watch; the wedge's are reported, not checked).
Prints a table, writes JSON; exit status 0 when every case passed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .stress_attacks import ATTACKS, run_attack
from .stress_cases import (engine_killed, engine_wedged,
                           router_unroutable, schema_fuzz, sigterm_mid_load,
                           streams_disconnects)
from .stress_kv import kv_forged_params, kv_idle_peers
from .stress_lib import ROOT, CaseResult, Server, Target

CASES = ["schema_fuzz", "streams_disconnects", *[f"attack:{a}" for a in ATTACKS],
         "router_unroutable", "sigterm_mid_load", "kv_transfer:forged_params",
         "kv_transfer:idle_peers", "engine_killed", "engine_wedged"]
HEADER_TIMEOUT, BODY_TIMEOUT, SHUTDOWN_TIMEOUT = 5.0, 5.0, 5.0
STEP_TIMEOUT, WEDGE_TOKEN = 2.0, 42      # server C: --step-timeout, the wedging token id
# servers B and C: `jaxserve serve` plus the kill switch and wedge hook, which live only in
# this module so that no flag of the real CLI can reach them
STRESS_SERVER = "jaxserve.tools.stress_server"


def serve_flags(ns: argparse.Namespace, key: str) -> list[str]:
    flags = ["--host", "127.0.0.1", "--port", "0", "--api-key", key, "--enable-admin-routes",
             "--max-model-len", str(ns.max_model_len),
             "--request-header-timeout", str(HEADER_TIMEOUT),
             "--request-body-timeout", str(BODY_TIMEOUT),
             "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
    return flags + ([ns.model] if ns.model else []) + ns.serve_arg


def target_of(server: Server, key: str) -> Target:
    assert server.url is not None
    return Target(url=server.url, pid=server.proc.pid, api_key=key,
                  header_timeout=HEADER_TIMEOUT, body_timeout=BODY_TIMEOUT).discover()


def timed(fn: Callable[[], CaseResult]) -> CaseResult:
    t0 = time.monotonic()
    res = fn()
    res.seconds = res.seconds or time.monotonic() - t0
    print(f"  {res.name}: {'ok' if res.ok else 'FAILED ' + '; '.join(res.failures)} "
          f"({res.seconds:.1f} s)", flush=True)
    return res


def run_server_a(ns: argparse.Namespace, key: str, logs: Path) -> list[CaseResult]:
    want = set(ns.cases)
    out: list[CaseResult] = []
    srv = Server([sys.executable, "-m", "jaxserve.cli", "serve", *serve_flags(ns, key)],
                 logs / "server_a.log")
    print(f"server A up in {srv.start_s:.0f} s at {srv.url} (pid {srv.proc.pid})", flush=True)
    try:
        t = target_of(srv, key)
        if "schema_fuzz" in want:
            out.append(timed(lambda: schema_fuzz(t, max_examples=ns.fuzz_examples,
                                                 seconds=ns.fuzz_seconds)))
        if "streams_disconnects" in want:
            out.append(timed(lambda: streams_disconnects(
                t, duration=ns.duration, concurrency=ns.concurrency, seed=ns.seed)))
        for name, fn in ATTACKS.items():
            if f"attack:{name}" in want:
                out.append(timed(lambda: run_attack(name, fn, t, storm=ns.storm)))
        if "router_unroutable" in want:
            out.append(timed(lambda: run_router_case(srv, t, key, logs)))
        if "sigterm_mid_load" in want:
            out.append(timed(lambda: sigterm_mid_load(t, srv.proc,
                                                      shutdown_timeout=SHUTDOWN_TIMEOUT)))
    finally:
        srv.stop()
    return out


def run_router_case(backend: Server, t: Target, key: str, logs: Path) -> CaseResult:
    assert backend.url is not None
    router = Server([sys.executable, "-m", "jaxserve.cli", "router", "--host", "127.0.0.1",
                     "--port", "0", "--backend", backend.url, "--api-key", key,
                     "--backend-api-key", key, "--poll-interval", "0.5"],
                    logs / "router.log", start_timeout=120, marker="routing")
    print(f"router up in {router.start_s:.0f} s at {router.url} (pid {router.proc.pid})",
          flush=True)
    try:
        rt = Target(url=str(router.url), pid=router.proc.pid, api_key=key, model=t.model,
                    vocab_size=t.vocab_size, max_model_len=t.max_model_len)
        return router_unroutable(rt, t)
    finally:
        router.stop()


def run_kv_pair(ns: argparse.Namespace, key: str, logs: Path) -> list[CaseResult]:
    """A prefill (kv_producer) and a decode (kv_consumer) server sharing a transfer
    secret of their own (not the API key)."""
    env = {"JAXSERVE_KV_TRANSFER_SECRET": secrets.token_urlsafe(24)}
    servers: list[Server] = []
    out: list[CaseResult] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            cfg = json.dumps({"kv_role": role, "kv_ip": "127.0.0.1"})
            srv = Server([sys.executable, "-m", "jaxserve.cli", "serve", *serve_flags(ns, key),
                          "--kv-transfer-config", cfg], logs / f"{role}.log", env=env)
            print(f"{role} up in {srv.start_s:.0f} s at {srv.url} (pid {srv.proc.pid})",
                  flush=True)
            servers.append(srv)
        pre, dec = servers
        tp, td = target_of(pre, key), target_of(dec, key)
        failures = lambda: sum("kv transfer: pull for" in ln    # noqa: E731
                               for ln in dec.log().splitlines())
        if "kv_transfer:forged_params" in ns.cases:
            out.append(timed(lambda: kv_forged_params(td)))
        if "kv_transfer:idle_peers" in ns.cases:
            out.append(timed(lambda: kv_idle_peers(tp, td, pull_failures=failures)))
    finally:
        for srv in reversed(servers):
            srv.stop()
    return out


def run_server_b(ns: argparse.Namespace, key: str, logs: Path) -> list[CaseResult]:
    srv = Server([sys.executable, "-m", STRESS_SERVER, *serve_flags(ns, key)],
                 logs / "server_b.log")
    print(f"server B up in {srv.start_s:.0f} s at {srv.url} (pid {srv.proc.pid})", flush=True)
    try:
        t = target_of(srv, key)
        kill = lambda: os.kill(srv.proc.pid, signal.SIGUSR1)    # noqa: E731
        return [timed(lambda: engine_killed(t, kill, srv.proc))]
    finally:
        srv.stop()


def run_server_c(ns: argparse.Namespace, key: str, logs: Path) -> list[CaseResult]:
    srv = Server([sys.executable, "-m", STRESS_SERVER,
                  "--stress-wedge-token", str(WEDGE_TOKEN), *serve_flags(ns, key),
                  "--step-timeout", str(STEP_TIMEOUT)], logs / "server_c.log")
    print(f"server C up in {srv.start_s:.0f} s at {srv.url} (pid {srv.proc.pid})", flush=True)
    try:
        t = target_of(srv, key)
        return [timed(lambda: engine_wedged(t, srv.proc, wedge_token=WEDGE_TOKEN,
                                            step_timeout=STEP_TIMEOUT,
                                            shutdown_timeout=SHUTDOWN_TIMEOUT))]
    finally:
        srv.stop()


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    import jax
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           text=True, capture_output=True).stdout.count("\n")
    return {"git_head": git, "modified_tracked_files": dirty, "cpu": cpu,
            "cores": os.cpu_count(), "mem_gib": round(int(mem) / 2**20, 1),
            "python": platform.python_version(), "jax": jax.__version__,
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items()) or "0"
    return "" if v is None else str(v)


def _router_note(seen: dict[str, Any]) -> str:
    plain = seen.get("a plain request", {}).get("status")
    bad = sorted({str(v["status"]) for k, v in seen.items() if k != "a plain request"})
    return f"{len(seen) - 1} bodies -> {'/'.join(bad)}, a plain one {plain}"


def note(r: CaseResult) -> str:
    """What the case saw, in a few words (the JSON has everything)."""
    f = r.figures
    if r.name == "attack:unauthenticated" and "seen" in f:
        n401 = sum(v["status"] == 401 for v in f["seen"].values())
        return f"{n401} x 401, /health {f['seen'].get('GET /health no key', {}).get('status')}"
    if "seen" in f and r.name.startswith("attack:") and "status" not in f["seen"]:
        got = sorted({str(v["status"]) for v in f["seen"].values()})
        n = len(f["seen"])
        return f"{n} request{'s' * (n > 1)} -> {'/'.join(got)}" + (
            f" in {f['answer_s']} s" if "answer_s" in f else "") + (
            ", no cached_tokens" if r.name == "attack:cached_tokens_hidden" and r.ok else "")
    known = {
        "schema_fuzz": lambda: ", ".join(f"{k}: {v}" for k, v in f["by_status"].items()),
        "streams_disconnects": lambda: f"{f['concurrency']} streams x {f['duration_s']:g} s, "
                                       f"lost/dup {f['lost_or_duplicated']}",
        "attack:abort_storm": lambda: f"{f['in_engine_at_disconnect']} in the engine; idle "
                                      f"{f['idle_after_s']} s after the clients left",
        "attack:flood_max_waiting": lambda: f"{f['status_503']} x 503 {'/'.join(f['codes'])}, "
                                            f"Retry-After {'/'.join(f['retry_after'])}",
        "attack:slowloris_headers": lambda: f"{f['closed_by_server']}/{f['sockets']} closed "
                                            f"by the server at {f['last_closed_s']} s",
        "attack:slow_body": lambda: f"{f['seen']['status']} after {f['seen']['after_s']} s",
        "router_unroutable": lambda: _router_note(f["seen"]),
        "kv_transfer:forged_params": lambda: f"impostor connections {f['impostor_connections']}, "
                                             f"same greedy answer {f['same_answer']}",
        "kv_transfer:idle_peers": lambda: f"{f['idle_connections']} idle peers "
                                          f"({f['idle_closed_by_server']} closed by the "
                                          f"server); transfer {f['seen']['decode']} in "
                                          f"{f['transfer_s']} s, failed pulls "
                                          f"{f['pull_failures']}",
        "sigterm_mid_load": lambda: f"streams ended {f['streams_ended_s']} s, exit "
                                    f"{f['exit_code']} at {f['exit_s']} s",
        "engine_wedged": lambda: f"/health {f['health_status']} {f['health_code']} at "
                                 f"{f['unhealthy_after_s']} s; stream {f['stream_outcome']}; "
                                 f"exit {f['exit_code']} at {f['exit_s']} s",
        "engine_killed": lambda: f"/health {f['health_status']} at {f['health_after_s']} s; "
                                 f"next request {f['request_status'] or 'refused'}; "
                                 f"exit {f['exit_code']}"}
    try:
        return known[r.name]() if r.name in known else ""
    except (KeyError, TypeError, ValueError, AttributeError):
        return ""


def table(results: list[CaseResult]) -> str:
    head = ["case", "ok", "sent", "completed", "aborted", "failed (reason)", "5xx",
            "leaked blocks", "victim max stall s", "health probes failed",
            "RSS MiB start/end", "s", "seen"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        f = r.figures
        rss = f"{f['rss_start_mib']:.0f} / " + (
            f"{f['rss_end_mib']:.0f}" if f["rss_end_mib"] else "exited") \
            if "rss_start_mib" in f else ""
        rows.append("| " + " | ".join([
            r.name, "yes" if r.ok else "**NO**", _cell(f.get("sent")), _cell(f.get("completed")),
            _cell(f.get("aborted")), _cell(f.get("failed")), _cell(f.get("status_5xx")),
            _cell(f.get("leaked_blocks")), _cell(f.get("victim_max_stall_s")),
            f"{f['health_probes_failed']}/{f['health_probes']}" if "health_probes" in f
            else "", rss, f"{r.seconds:.1f}", note(r)]) + " |")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180, help="seconds of streams_disconnects")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--fuzz-seconds", type=float, default=60)
    p.add_argument("--fuzz-examples", type=int, default=40, help="per operation and mode")
    p.add_argument("--storm", type=int, default=800, help="requests in attack:abort_storm")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="+", default=CASES, choices=CASES, metavar="CASE")
    p.add_argument("--output-json", default=None,
                   help="default: stress-results-<date>.json in the system temp dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    key = secrets.token_urlsafe(16)
    logs = Path(tempfile.mkdtemp(prefix="jaxserve-stress-"))
    started = datetime.datetime.now(datetime.timezone.utc)
    info = machine()
    print(f"jaxserve stress: logs in {logs}; machine {info}", flush=True)
    t0 = time.monotonic()
    results = run_server_a(ns, key, logs)
    if any(c.startswith("kv_transfer:") for c in ns.cases):
        results += run_kv_pair(ns, key, logs)
    if "engine_killed" in ns.cases:
        results += run_server_b(ns, key, logs)
    if "engine_wedged" in ns.cases:
        results += run_server_c(ns, key, logs)
    total = time.monotonic() - t0
    print("\n" + table(results))
    for r in results:
        for f in r.failures:
            print(f"FAILED {r.name}: {f}")
    out = Path(ns.output_json or Path(tempfile.gettempdir()) /
               f"stress-results-{started:%Y-%m-%d}.json")
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "date": started.isoformat(timespec="seconds"), "machine": info,
        "server_flags": serve_flags(ns, "KEY"), "total_s": round(total, 1),
        "ok": all(r.ok for r in results), "cases": [r.as_dict() for r in results]}, indent=1))
    print(f"\n{sum(r.ok for r in results)}/{len(results)} cases passed in {total:.0f} s; "
          f"JSON: {out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
