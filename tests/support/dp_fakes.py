"""Stand-ins for the data-parallel supervisor's collaborators (router/dp_supervisor.py),
so its rules run on a fake clock: a child process and the router's backend pool."""
from __future__ import annotations

from jaxserve.router.dp_supervisor import Replica, RestartPolicy, Supervisor


class FakeProc:
    """A child as the supervisor sees it: poll() -> None while alive, else its status;
    the signals sent to it are recorded."""

    def __init__(self, pid: int) -> None:
        self.pid, self.code, self.signals = pid, None, []

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


class FakePool:
    """The router's backends (url, healthy) and the mark_down calls the supervisor made."""

    def __init__(self, urls: list[str], healthy: bool = True) -> None:
        self.backends = [type("B", (), {"url": u, "healthy": healthy})() for u in urls]
        self.downs: list[tuple[str, str]] = []

    def mark_down(self, b, reason: str) -> None:
        b.healthy = False
        self.downs.append((b.url, reason))


def supervised(policy: RestartPolicy, *, healthy: bool = True
               ) -> tuple[Supervisor, FakePool, list[FakeProc], list[float]]:
    """Two replicas under a Supervisor on a fake clock, started: (supervisor, the pool
    whose backends start healthy or not, the fake children spawned so far (in order),
    the clock [now] to move)."""
    now = [0.0]
    spawned: list[FakeProc] = []

    def spawn(r: Replica) -> FakeProc:
        spawned.append(FakeProc(100 + len(spawned)))
        return spawned[-1]
    reps = [Replica(i, f"http://r{i}", [], {}) for i in range(2)]
    sup = Supervisor(reps, spawn=spawn, policy=policy, clock=lambda: now[0])
    sup.start_all()
    return sup, FakePool([r.url for r in reps], healthy=healthy), spawned, now
