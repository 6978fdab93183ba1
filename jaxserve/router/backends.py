"""The router's backends: health checks and load polling, one loop for all of them.

    pool = BackendPool(["http://10.0.0.1:8000", ...], api_key=None, poll_load=True)
    await pool.start()          # one check round before serving, then every interval
    pool.healthy()              # -> [Backend] in configuration order
    pool.mark_down(b, "connection refused")      # the proxy saw it fail
    await pool.stop()

A backend is up while its GET /health answers 200 (a jaxserve server answers 503
while its engine is dead or stalled, or while it drains at shutdown: it should get no
new work then). It goes down at once on a refused connection or a non-200 answer, after
TIMEOUT_STRIKES timed-out checks in a row (a busy host may answer slowly), or when a
proxied request fails at the transport level; the next good check brings it back.
With poll_load, each round also reads the backend's /metrics (jaxserve's or vLLM's
names, --metrics-compat either way) for its running + waiting requests.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from jaxserve.deps import require

log = logging.getLogger("jaxserve.router")

TIMEOUT_STRIKES = 2
LOAD_GAUGES = {"num_requests_running", "num_requests_waiting"}


@dataclass(slots=True)
class Timeouts:
    """Seconds. read: the longest gap between two bytes from a backend (a non-streamed
    request's whole generation, a stream's gap between tokens)."""
    connect: float = 5.0
    read: float = 600.0
    write: float = 30.0
    pool: float = 30.0
    check: float = 5.0        # one /health or /metrics call


@dataclass(slots=True)
class Backend:
    url: str
    index: int
    healthy: bool = True
    inflight: int = 0               # requests this router has open on it now
    reported: float = 0.0           # running + waiting, from its last /metrics
    strikes: int = 0                # timed-out checks in a row
    reason: str = ""                # why it is down

    @property
    def load(self) -> float:
        # The router's own count is fresh; the backend's count also sees other clients
        # (and other routers) but is one poll old. The larger one is the safer guess.
        return max(float(self.inflight), self.reported)


@dataclass(slots=True)
class BackendPool:
    urls: list[str]
    api_key: str | None = None
    poll_load: bool = False
    interval: float = 1.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    backends: list[Backend] = field(init=False)
    client: Any = field(init=False, default=None)
    _task: asyncio.Task | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("give at least one --backend URL")
        clean = [check_url(u) for u in self.urls]
        if len(set(clean)) != len(clean):
            raise ValueError("the same --backend URL is given twice")
        self.backends = [Backend(u, i) for i, u in enumerate(clean)]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def start(self) -> None:
        httpx = require("httpx", extra="router", feature="jaxserve router")
        t = self.timeouts
        # Every backend call has a deadline; the pool is large enough for many concurrent
        # streams (each holds a connection for its whole length).
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
            transport=transport(httpx, httpx.Limits(max_connections=4096,
                                                    max_keepalive_connections=256)),
            trust_env=False, follow_redirects=False)
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def mark_down(self, b: Backend, reason: str) -> None:
        if b.healthy:
            log.warning("backend %s is down: %s", b.url, reason)
        b.healthy, b.reason = False, reason

    def _mark_up(self, b: Backend) -> None:
        if not b.healthy:
            log.info("backend %s is back up", b.url)
        b.healthy, b.reason, b.strikes = True, "", 0

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:       # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("backend check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))

    async def check(self, b: Backend) -> None:
        import httpx
        try:
            r = await self.client.get(f"{b.url}/health", headers=self.headers,
                                      timeout=self.timeouts.check)
        except httpx.TimeoutException:
            b.strikes += 1
            if b.strikes >= TIMEOUT_STRIKES:
                self.mark_down(b, f"/health timed out {b.strikes} times in a row")
            return
        except httpx.HTTPError as e:
            self.mark_down(b, f"/health: {type(e).__name__}: {e}")
            return
        if r.status_code != 200:
            self.mark_down(b, f"/health answered {r.status_code}")
            return
        self._mark_up(b)
        if self.poll_load:
            await self._poll_load(b)

    async def _poll_load(self, b: Backend) -> None:
        import httpx
        try:
            r = await self.client.get(f"{b.url}/metrics", headers=self.headers,
                                      timeout=self.timeouts.check)
        except httpx.HTTPError as e:
            log.debug("backend %s /metrics: %s", b.url, e)
            return          # health decides up/down; keep the last reading
        if r.status_code == 200:
            b.reported = parse_load(r.text)
        else:
            log.warning("backend %s /metrics answered %d (is --backend-api-key right?)",
                        b.url, r.status_code)


def transport(httpx: Any, limits: Any) -> Any:
    """httpx's transport, with one race turned into the transport error it is: a backend
    that closes a connection while httpcore sets it up (a server being killed) can make
    anyio read the address of a socket that is already gone, and that surfaces as an
    AttributeError instead of an httpx.HTTPError. As a ConnectError the proxy retries
    the request on another backend and marks this one down, as for a refused connection."""
    class Transport(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: Any) -> Any:
            try:
                return await super().handle_async_request(request)
            except AttributeError as e:
                raise httpx.ConnectError(f"the connection closed while it was set up ({e})",
                                         request=request) from e
    return Transport(limits=limits, trust_env=False)


def parse_load(text: str) -> float:
    """running + waiting requests from Prometheus text with jaxserve: or vllm: names
    (summed over label sets: a data-parallel server may report one per engine)."""
    total = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        prefix, _, short = name.partition(":")
        if prefix in ("jaxserve", "vllm") and short in LOAD_GAUGES:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


def check_url(url: str) -> str:
    """A backend's base URL (no trailing / or /v1); ValueError unless http(s)."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):           # people paste the OpenAI base URL
        u = u[:-3]
    if not u.startswith(("http://", "https://")) or len(u.split("://", 1)[1]) == 0:
        raise ValueError(f"--backend must be an http(s) URL like http://127.0.0.1:8000, "
                         f"got {url!r}")
    return u
