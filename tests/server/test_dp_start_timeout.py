"""Data-parallel replica processes that hang while starting (`--replica-start-timeout`,
router/dp_supervisor.py): a replica alive but not healthy by the deadline is stopped
(SIGTERM to its PID, SIGKILL after the grace period) and restarted under the same
backoff and give-up rules as a replica that died. First the rules on a fake clock, then
real child processes: a stand-in child that hangs deaf to SIGTERM on its first start and
serves /health on its second, driven by the same start-up loop `jaxserve serve` runs."""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest


from jaxserve.cli import build_parser  # noqa: E402
from jaxserve.cli_args import engine_args  # noqa: E402
from jaxserve.router.dp_processes import _free_ports, _spawn, _stop, wait_started  # noqa: E402
from jaxserve.router.dp_supervisor import Replica, RestartPolicy, Supervisor  # noqa: E402
from dp_fakes import FakePool, FakeProc, supervised  # noqa: E402
from server_harness import pid_alive  # noqa: E402


def test_the_flag_is_a_serve_flag_and_stays_with_the_parent(capsys):
    ns = build_parser().parse_args(["serve", "--replica-start-timeout", "90"])
    assert engine_args(ns).replica_start_timeout == 90.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--replica-start-timeout" in capsys.readouterr().out
    from jaxserve.router.dp_processes import child_argv
    argv = child_argv(engine_args(ns).replace(data_parallel_size=2,
                                        data_parallel_backend="processes"), 1234)
    assert "--replica-start-timeout" not in argv       # a replica supervises nothing


def test_a_start_past_the_deadline_is_stopped_then_restarted_then_given_up():
    sup, pool, spawned, now = supervised(RestartPolicy(
        max_restarts=1, backoff_s=1.0, start_timeout_s=10.0, kill_grace_s=2.0), healthy=False)
    r0 = sup.replicas[0]
    now[0] = 5.0
    pool.backends[1].healthy = True             # replica 1 is up in time
    sup.tick(pool)
    now[0] = 9.9
    sup.tick(pool)
    assert spawned[0].signals == [] and pool.downs == []
    now[0] = 10.0                               # replica 0: deadline
    sup.tick(pool)
    assert spawned[0].signals == [signal.SIGTERM]
    assert pool.downs == [("http://r0", "replica process 100 not healthy 10 s after its "
                                        "start")]
    now[0] = 11.9
    sup.tick(pool)
    assert spawned[0].signals == [signal.SIGTERM]       # grace
    now[0] = 12.0
    sup.tick(pool)
    now[0] = 12.5
    sup.tick(pool)
    assert spawned[0].signals == [signal.SIGTERM, signal.SIGKILL]     # once
    spawned[0].code = -9
    sup.tick(pool)
    assert r0.proc is None and r0.restart_at == 13.5 and not r0.given_up
    now[0] = 13.5
    sup.tick(pool)
    assert r0.proc is spawned[2] and r0.restarts == 1
    now[0] = 23.4                               # the deadline counts from this start
    sup.tick(pool)
    assert spawned[2].signals == []
    now[0] = 23.5
    sup.tick(pool)
    assert spawned[2].signals == [signal.SIGTERM]
    spawned[2].code = 0                         # even a clean exit: a failed start
    sup.tick(pool)
    assert r0.given_up and len(spawned) == 3    # max_restarts=1 used up
    now[0] = 1e6
    sup.tick(pool)
    assert spawned[1].signals == [] and len(spawned) == 3  # the healthy one untouched


def test_no_deadline_with_zero():
    now = [0.0]
    proc = FakeProc(7)
    sup = Supervisor([Replica(0, "http://r0", [], {})], spawn=lambda r: proc,
                     clock=lambda: now[0], policy=RestartPolicy(start_timeout_s=0))
    sup.start_all()
    now[0] = 1e7
    sup.tick(FakePool(["http://r0"], healthy=False))
    assert proc.signals == []


# A stand-in replica: its first start hangs and ignores SIGTERM (the marker file tells
# a restart from a first start); a later start answers 200 on every GET.
FAKE_CHILD = """
import http.server, os, signal, sys, time
marker, port = sys.argv[1], int(sys.argv[2])
if not os.path.exists(marker):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(marker, "w").close()
    time.sleep(600)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _replicas(tmp_path: Path, script: str) -> list[Replica]:
    ports = _free_ports(2)
    return [Replica(i, f"http://127.0.0.1:{ports[i]}",
                    [sys.executable, "-c", script, str(tmp_path / f"started{i}"),
                     str(ports[i])], dict(os.environ)) for i in range(2)]


def test_a_hung_child_process_is_killed_and_restarted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve")
    reps = _replicas(tmp_path, FAKE_CHILD)
    (tmp_path / "started1").touch()             # replica 1 starts healthy at once
    # bounded: at most 3 starts of 5 s + 1 s grace each before wait_started gives up
    sup = Supervisor(reps, spawn=_spawn, policy=RestartPolicy(
        max_restarts=2, backoff_s=0.2, start_timeout_s=5.0, kill_grace_s=1.0, poll_s=0.1))
    first = []
    try:
        t0 = time.monotonic()
        sup.start_all()
        first = [r.proc for r in reps]
        wait_started(sup, None)
        took = time.monotonic() - t0
        r0, r1 = reps
        assert first[0].returncode == -signal.SIGKILL   # it ignored SIGTERM
        assert not pid_alive(first[0].pid)
        assert r0.restarts == 1 and r0.proc is not first[0] and not r0.given_up
        assert r1.restarts == 0 and r1.proc is first[1] and first[1].poll() is None
        assert 6.0 <= took < 40, took               # deadline + grace, then a restart
        for r in reps:
            assert httpx.get(f"{r.url}/health", timeout=5).status_code == 200
        text = caplog.text
        assert "replica 0" in text and "not healthy 5 s after its start" in text
        assert "SIGKILL" in text and "replica 1 (" not in text
    finally:
        _stop([p for p in [*first, *sup.processes()] if p is not None], 5)


def test_a_child_that_exits_while_starting_fails_the_start(tmp_path):
    reps = _replicas(tmp_path, "import sys; sys.exit(3)")
    sup = Supervisor(reps, spawn=_spawn, policy=RestartPolicy(poll_s=0.1))
    try:
        sup.start_all()
        with pytest.raises(RuntimeError, match="exited with status 3 while starting"):
            wait_started(sup, None)
        assert all(r.restarts == 0 for r in reps)   # a bad flag: no restart loop
    finally:
        _stop(sup.processes(), 5)
