"""One helper for start-up work that runs beside the caller's own."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


def beside(fn: Callable[..., Any], *args: Any, name: str) -> Future:
    """fn(*args) on a thread of its own (named `name`), started now; the future's
    result() waits for it and re-raises its error."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)
