"""Count the compiles jax itself logs: every compile request (an XLA compile or a load
from the persistent compilation cache) logs "Compiling <fn>" under jax_log_compiles,
which also sees a compile whose trace was reused (the engine's own counters cannot)."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import jax

_LOGGER = "jax._src.interpreters.pxla"


class CompileLog(logging.Handler):
    """names: the function name of every compile logged while recording."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            self.names.append(msg.split(" with ")[0])


@contextlib.contextmanager
def recording_compiles() -> Iterator[CompileLog]:
    handler = CompileLog()
    logger = logging.getLogger(_LOGGER)
    logger.addHandler(handler)
    old = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler
    finally:
        jax.config.update("jax_log_compiles", old)
        logger.removeHandler(handler)
