"""The server and the router print their address once the socket is bound; a client that
connects right then must be queued, not refused (test_multihost's two-host serve test
connected in that window under load and got ECONNREFUSED)."""
import socket

from jaxserve.router import app as router_app
from jaxserve.server import launch as server_main
from jaxserve.server.listen import bind


def test_server_and_router_bind_through_the_listening_helper():
    assert server_main.bind is bind and router_app.bind is bind


def test_a_client_can_connect_before_uvicorn_serves():
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
