"""uvicorn, hardened for `jaxserve serve`.

    server = make_server(app, engine, args, sockets)   # a DrainingServer
    server.run(sockets=[sock]); server.exit_code       # 0, or 1 if the engine died

* Header deadline: uvicorn arms no timer while a connection sends its request line and
  headers, so a client that trickles them (slowloris) holds a connection forever. The
  h11 protocol here closes a connection whose headers are not complete within
  --request-header-timeout s of connecting or of its previous response. (The body has
  its own deadline in middleware.py; idle keep-alive connections uvicorn's 5 s.)
* --limit-concurrency: uvicorn's own (503 beyond that many connections + tasks).
* Drain at SIGTERM: stop accepting, let open requests finish for --shutdown-timeout s,
  then end the rest with an error (a stream gets an error event and `data: [DONE]`),
  then uvicorn's graceful shutdown flushes them.
  A stream is ended from the event loop if the engine thread is too stuck to end it.
* Exit is bounded: a second SIGTERM / SIGINT during the drain exits at once with status
  128 + the signal's number, and the first signal arms a deadline (--shutdown-timeout +
  EXIT_GRACE_SECONDS) after which the process exits with status 1 whatever it is waiting
  on. Both use os._exit: nothing that is stuck (a wedged engine thread, an atexit hook
  waiting on it) can keep the process alive.
* Engine death: the server drains what it can and exits with status 1, so a supervisor
  restarts it (docs/serving.md).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.config import EngineArgs

log = logging.getLogger("jaxserve")

FLUSH_SECONDS = 5       # after the drain: time for responses to write their last bytes
# After the drain: the flush, the engine thread's stop and the interpreter's own exit
# (XLA teardown can take seconds on a loaded small machine).
EXIT_GRACE_SECONDS = 20.0
EXIT_DEADLINE_STATUS = 1


def hard_exit(status: int, message: str) -> None:
    """Log, flush, and end the process now: no atexit hooks, no thread joins."""
    log.error("%s", message)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


class HeaderDeadlineH11(H11Protocol):
    header_timeout: float = 10.0            # set per server (see header_deadline_protocol)
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:   # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        # IDLE on their side: the next request's headers are not complete yet.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection that sent no complete request headers in %g s",
                     self.header_timeout)
            self.transport.close()


def header_deadline_protocol(timeout: float) -> type[HeaderDeadlineH11]:
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout": timeout})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._exit_deadline: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Main thread (uvicorn's handler for SIGINT / SIGTERM)."""
        if self.should_exit:            # the drain is under way: the operator wants out
            hard_exit(128 + sig, f"{signal.Signals(sig).name} again during shutdown: "
                                 f"exiting now with status {128 + sig}")
        super().handle_exit(sig, frame)
        self._arm_exit_deadline()

    def _arm_exit_deadline(self) -> None:
        if self._exit_deadline is not None:
            return
        seconds = self.drain_timeout + EXIT_GRACE_SECONDS

        def expire() -> None:
            time.sleep(seconds)
            hard_exit(EXIT_DEADLINE_STATUS,
                      f"still running {seconds:g} s after the shutdown signal (shutdown "
                      f"timeout {self.drain_timeout:g} s + {EXIT_GRACE_SECONDS:g} s): "
                      f"exiting now with status {EXIT_DEADLINE_STATUS}")
        # A daemon thread: it must not itself keep the process alive.
        self._exit_deadline = threading.Thread(target=expire, daemon=True,
                                               name="jaxserve-exit-deadline")
        self._exit_deadline.start()

    async def on_tick(self, counter: int) -> bool:
        if self.engine.is_dead():
            if self.exit_code == 0:
                log.error("the engine died (%s): draining, then exiting with status 1",
                          self.engine.error)
            self.exit_code = 1
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:          # stop accepting before draining
            server.close()
        ended = await self.engine.drain(self.drain_timeout)
        if ended:
            log.warning("drain: %d request(s) ended with an error at the %g s deadline",
                        ended, self.drain_timeout)
        await super().shutdown(sockets)


def make_server(app: Any, engine: Any, args: EngineArgs, **config: Any) -> DrainingServer:
    """config: uvicorn.Config overrides (tests: log_level)."""
    kw: dict[str, Any] = dict(
        lifespan="on", http=header_deadline_protocol(args.request_header_timeout),
        limit_concurrency=args.limit_concurrency, timeout_graceful_shutdown=FLUSH_SECONDS,
        timeout_keep_alive=5, log_level="info", access_log=False)
    return DrainingServer(uvicorn.Config(app, **{**kw, **config}), engine,
                          args.shutdown_timeout)
