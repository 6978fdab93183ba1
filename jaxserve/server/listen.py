"""The listening socket of `jaxserve serve` and `jaxserve router` (no jax import here:
the router never loads the engine)."""
from __future__ import annotations

import socket

BACKLOG = 2048     # uvicorn's default


def bind(host: str, port: int) -> socket.socket:
    """Bind first (port 0 = any free port), so the address printed is the real one, and
    listen at once: a client that connects as soon as the address is printed waits in the
    backlog until uvicorn serves, instead of being refused (a test that did so failed)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock
