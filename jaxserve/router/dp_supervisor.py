"""Restart data-parallel replica processes that die (dp_processes.py), with bounded
restarts and backoff. It runs as a watcher inside the router's event loop (one poll
every RestartPolicy.poll_s), so it sees the same backend pool the router routes with.

    replica i dies (SIGKILL, OOM, engine failure -> exit 1)
      -> logged; pool.mark_down: no new request goes there (requests in flight on it
         follow the router's rules: retried before their first token, else an error event)
      -> after backoff_s * 2**n (at most max_backoff_s) the same command is started again,
         on the same port and devices
      -> the router's health loop puts it back when its /health answers 200 (after
         loading and warm-up); healthy for stable_s -> its restart count starts again
      -> dead max_restarts times in a row without that: given up on, with an error log;
         the router serves with the others (its /health is 503 once none is left)

    replica i alive but not healthy start_timeout_s after its start (a hung load or
    warm-up: a stuck filesystem, a device that never answers)
      -> logged; SIGTERM to its PID, SIGKILL kill_grace_s later if it is still there;
         its exit then counts as a death above (restart with backoff, or give up).
         Only a start is timed: once healthy, a replica is judged by its exits (a
         stalled step turns its /health 503, and the router routes around it)

A replica that exits with status 0 was stopped on purpose (SIGTERM or Ctrl-C drain
cleanly to 0): it is taken out but not restarted.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("jaxserve")


@dataclass(slots=True)
class RestartPolicy:
    max_restarts: int = 5           # deaths in a row (none stayed up stable_s) before giving up
    backoff_s: float = 1.0          # wait before the first restart; doubles each time
    max_backoff_s: float = 30.0
    stable_s: float = 60.0          # healthy this long after a restart: the count resets
    poll_s: float = 0.5
    start_timeout_s: float = 1800.0  # spawn -> healthy, else stopped and restarted; 0: none
    kill_grace_s: float = 10.0      # SIGTERM -> SIGKILL for a start that timed out

    def delay(self, restarts: int) -> float:
        return min(self.backoff_s * 2.0 ** restarts, self.max_backoff_s)


@dataclass(slots=True)
class Replica:
    index: int
    url: str
    argv: list[str]
    env: dict[str, str]
    proc: Any = None                    # subprocess.Popen; None while a restart waits
    restarts: int = 0                   # in a row, reset after stable_s healthy
    restart_at: float | None = None     # time.monotonic() of the pending restart
    up_since: float | None = None       # when the router last saw it healthy
    given_up: bool = False
    started_at: float = 0.0             # clock() when this process was spawned
    hung_since: float | None = None     # clock() when its timed-out start got SIGTERM
    sigkilled: bool = False


@dataclass(slots=True)
class Supervisor:
    replicas: list[Replica]
    spawn: Callable[[Replica], Any]     # -> a started subprocess.Popen
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic

    def start_all(self) -> None:
        for r in self.replicas:
            r.proc = self.spawn(r)
            r.started_at = self.clock()

    def processes(self) -> list[subprocess.Popen]:
        return [r.proc for r in self.replicas if isinstance(r.proc, subprocess.Popen)]

    async def watch(self, pool: Any) -> None:
        """RouterConfig.watchers entry: poll until cancelled. Runs on the event loop's
        thread, which is the main thread: Linux's PR_SET_PDEATHSIG (dp_processes.py)
        fires when the *thread* that started a child ends, so no helper thread may.
        The replicas come from dp_processes.wait_started: healthy or given up."""
        while True:
            self.tick(pool)
            await asyncio.sleep(self.policy.poll_s)

    def tick(self, pool: Any) -> None:
        now = self.clock()
        for r in self.replicas:
            if r.given_up:
                continue
            backend = next(b for b in pool.backends if b.url == r.url)
            if r.proc is None:
                if r.restart_at is not None and now >= r.restart_at:
                    self._restart(r)
                continue
            code = r.proc.poll()
            if code is not None:
                self._died(r, code, pool, backend, now)
            elif r.hung_since is not None:
                self._escalate(r, now)
            else:
                self._track(r, backend.healthy, now)
                self._check_start(r, pool, backend, now)

    def _track(self, r: Replica, healthy: bool, now: float) -> None:
        if not healthy:
            return
        if r.up_since is None:
            r.up_since = now
            if r.restarts:
                log.info("data parallel: replica %d (%s) is healthy again after restart %d",
                         r.index, r.url, r.restarts)
        elif r.restarts and now - r.up_since >= self.policy.stable_s:
            r.restarts = 0

    def _check_start(self, r: Replica, pool: Any, backend: Any, now: float) -> None:
        """Alive but never healthy since its spawn, past the start-up deadline: stop it
        (its exit is then handled as a death)."""
        limit = self.policy.start_timeout_s
        if r.up_since is not None or limit <= 0 or now - r.started_at < limit:
            return
        log.error("data parallel: replica %d (%s, process %d) is not healthy %.0f s after "
                  "its start (--replica-start-timeout); stopping it (SIGTERM, SIGKILL after "
                  "%.0f s)", r.index, r.url, r.proc.pid, limit, self.policy.kill_grace_s)
        pool.mark_down(backend, f"replica process {r.proc.pid} not healthy {limit:.0f} s "
                                f"after its start")
        r.hung_since = now
        r.proc.send_signal(signal.SIGTERM)

    def _escalate(self, r: Replica, now: float) -> None:
        assert r.hung_since is not None
        if r.sigkilled or now - r.hung_since < self.policy.kill_grace_s:
            return
        log.error("data parallel: replica %d (process %d) still alive %.0f s after SIGTERM; "
                  "SIGKILL", r.index, r.proc.pid, self.policy.kill_grace_s)
        r.sigkilled = True
        r.proc.send_signal(signal.SIGKILL)

    def _died(self, r: Replica, code: int, pool: Any, backend: Any, now: float) -> None:
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        hung = r.hung_since is not None
        if hung:                            # stopped by us: a failed start, whatever the status
            how = (f"not healthy {self.policy.start_timeout_s:.0f} s after its start; "
                   f"stopped, {how}")
        pool.mark_down(backend, f"replica process {r.proc.pid} ended ({how})")
        r.proc, r.up_since, r.hung_since, r.sigkilled = None, None, None, False
        if code == 0 and not hung:
            r.given_up = True
            log.warning("data parallel: replica %d (%s) stopped cleanly (status 0: stopped "
                        "on purpose); not restarting it", r.index, r.url)
        elif r.restarts >= self.policy.max_restarts:
            r.given_up = True
            log.error("data parallel: replica %d (%s) died (%s) %d times in a row without "
                      "staying up %.0f s; giving up on it. %d of %d replicas left",
                      r.index, r.url, how, r.restarts + 1, self.policy.stable_s,
                      sum(not x.given_up for x in self.replicas), len(self.replicas))
        else:
            wait = self.policy.delay(r.restarts)
            r.restart_at = now + wait
            log.error("data parallel: replica %d (%s) died (%s); restarting it in %.1f s "
                      "(restart %d of at most %d in a row)", r.index, r.url, how, wait,
                      r.restarts + 1, self.policy.max_restarts)

    def _restart(self, r: Replica) -> None:
        r.restarts += 1
        r.restart_at = None
        r.started_at = self.clock()
        try:
            r.proc = self.spawn(r)
        except OSError as e:                # counts as a death: backoff, then the limit
            log.error("data parallel: replica %d could not be started: %s", r.index, e)
            r.proc = _Exited(1)
            return
        log.info("data parallel: replica %d restarted as process %d on %s", r.index,
                 r.proc.pid, r.url)


@dataclass(slots=True)
class _Exited:
    """Stands in for a child that could not even be started."""
    returncode: int
    pid: int = -1

    def poll(self) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass
