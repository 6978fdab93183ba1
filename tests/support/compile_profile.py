"""A pytest plugin: per test, its wall time, the CPU time of its process and of the
processes it started and reaped ("cpu", "child_cpu": getrusage), and the time jax spent
tracing, lowering and compiling (jax.monitoring's duration events), with the backend
compile seconds of each program by name ("programs"), one JSON line per test in
$COMPILE_PROFILE_DIR/<pid>.jsonl (default: compile_profile/ under the current directory;
each xdist worker writes its own file). Not loaded unless named:

    PYTHONPATH=tests/support .venv/bin/python -m pytest tests -n 2 --dist loadfile \
        -p compile_profile

Sum the lines per file or tier to see where a run's time goes (docs/benchmarks.md,
"Test suite").
"""
from __future__ import annotations

import collections
import json
import os
import resource
import time
from typing import Any, Iterator

import pytest

_secs: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_by_name: collections.Counter = collections.Counter()     # backend compile secs per program
_listening = [False]
_out: Any = None


def _listen() -> None:
    """Registered at the first test, after the conftest has settled the device flags."""
    if _listening[0]:
        return
    import jax.monitoring

    def duration(event: str, secs: float, fun_name: str = "", **_: Any) -> None:
        _secs[event] += secs
        _counts[event] += 1
        if event.endswith("backend_compile_duration"):
            _by_name[fun_name or "?"] += secs
    jax.monitoring.register_event_duration_secs_listener(duration)
    _listening[0] = True


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_configure(config: pytest.Config) -> None:
    global _out
    folder = os.environ.get("COMPILE_PROFILE_DIR", "compile_profile")
    os.makedirs(folder, exist_ok=True)
    _out = open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    _listen()
    secs0, counts0 = dict(_secs), dict(_counts)
    _by_name.clear()
    t0, cpu0 = time.perf_counter(), _cpu()
    result = yield
    cpu1 = _cpu()
    rec: dict[str, Any] = {"id": item.nodeid, "wall": round(time.perf_counter() - t0, 3),
                           "cpu": round(cpu1[0] - cpu0[0], 3),
                           "child_cpu": round(cpu1[1] - cpu0[1], 3)}
    for event, s in _secs.items():
        if s - secs0.get(event, 0.0) > 1e-3:
            rec[event] = round(s - secs0.get(event, 0.0), 3)
            rec["n:" + event] = _counts[event] - counts0.get(event, 0)
    if _by_name:       # the compiled programs by name, with their backend compile secs
        rec["programs"] = {k: round(v, 3) for k, v in _by_name.most_common()}
    _out.write(json.dumps(rec) + "\n")
    _out.flush()
    return result
