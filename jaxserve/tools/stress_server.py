"""`jaxserve serve` with two faults the stress suite triggers from outside: an engine
thread that dies (engine_killed) and one that is wedged (engine_wedged).

    python -m jaxserve.tools.stress_server [--stress-wedge-token N] [serve flags...]

Everything is the CLI's serve path (jaxserve.cli.main(["serve", ...])); the additions:

* SIGUSR1 raises SystemExit inside the engine thread (ctypes PyThreadState_SetAsyncExc),
  so the engine thread dies the way an unexpected fatal error in a step would kill it,
  triggered from outside the process. SystemExit rather than an Exception so that no
  per-request handler can mistake it for one request's failure.
* --stress-wedge-token N: a request whose prompt starts with token id N wedges the
  engine thread inside add_request (a busy Python loop of WEDGE_SECONDS), as a
  pathological admission computation would; the thread is alive but its loop stops
  turning. No flag or route of `jaxserve serve` itself can do this.
"""
from __future__ import annotations

import ctypes
import signal
import sys
import time
from typing import Any, Callable

import jaxserve.server.launch as server_main
from jaxserve.cli import main

WEDGE_SECONDS = 120.0       # long past the case's deadlines, short enough to end by itself


def _with_faults(build: Callable[..., Any], wedge_token: int | None) -> Callable[..., Any]:
    def build_engine(*args: Any, **kw: Any) -> Any:
        engine = build(*args, **kw)

        def kill(*_: Any) -> None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(engine._thread.ident),
                                                       ctypes.py_object(SystemExit))
        signal.signal(signal.SIGUSR1, kill)      # build_engine runs on the main thread
        if wedge_token is not None:
            add = engine.core.add_request

            def wedged(request: Any) -> None:
                if request.prompt_token_ids[:1] == [wedge_token]:
                    end, x = time.monotonic() + WEDGE_SECONDS, 0
                    while time.monotonic() < end:
                        x = (x * 31 + 7) % 1000003
                add(request)
            engine.core.add_request = wedged
        return engine
    return build_engine


def _pop_wedge_token(argv: list[str]) -> tuple[int | None, list[str]]:
    if "--stress-wedge-token" not in argv:
        return None, argv
    i = argv.index("--stress-wedge-token")
    return int(argv[i + 1]), argv[:i] + argv[i + 2:]


if __name__ == "__main__":
    token, rest = _pop_wedge_token(sys.argv[1:])
    server_main.build_engine = _with_faults(server_main.build_engine, token)
    sys.exit(main(["serve", *rest]))
