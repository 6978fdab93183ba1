"""The server and the router print their address once the socket is bound; a client that
connects right then must be queued, not refused (test_multihost's two-host serve test
connected in that window under load and got ECONNREFUSED)."""
import socket

import pytest

from jaxserve.router.app import _bind as router_bind
from jaxserve.server.main import bind as server_bind


@pytest.mark.parametrize("bind", [server_bind, router_bind], ids=["server", "router"])
def test_a_client_can_connect_before_uvicorn_serves(bind):
    sock = bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            conn, _ = sock.accept()       # it waited in the backlog
            with conn:
                client.sendall(b"ping")
                assert conn.recv(4) == b"ping"
    finally:
        sock.close()
