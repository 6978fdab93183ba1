"""`jaxserve serve` with a kill switch, for the stress suite's engine_killed case.

    python scripts/stress_server.py [serve flags...]      # same flags as `jaxserve serve`

Everything is the CLI's serve path (jaxserve.cli.main(["serve", ...])); the only addition:
SIGUSR1 raises SystemExit inside the engine thread (ctypes PyThreadState_SetAsyncExc),
so the engine thread dies the way an unexpected fatal error in a step would kill it,
triggered from outside the process. SystemExit rather than an Exception so that no
per-request handler can mistake it for one request's failure.
"""
from __future__ import annotations

import ctypes
import signal
import sys
from typing import Any, Callable

import jaxserve.server.main as server_main
from jaxserve.cli import main


def _with_kill_switch(build: Callable[..., Any]) -> Callable[..., Any]:
    def build_engine(*args: Any, **kw: Any) -> Any:
        engine = build(*args, **kw)

        def kill(*_: Any) -> None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(engine._thread.ident),
                                                       ctypes.py_object(SystemExit))
        signal.signal(signal.SIGUSR1, kill)      # build_engine runs on the main thread
        return engine
    return build_engine


if __name__ == "__main__":
    server_main.build_engine = _with_kill_switch(server_main.build_engine)
    sys.exit(main(["serve", *sys.argv[1:]]))
