"""Helpers for tests/server/test_router*.py: a uvicorn thread for any ASGI app, a scripted
fake backend for the failure modes a real server cannot be made to show on cue, and the
`fakes` / `router` fixtures that start them (import them into a test module)."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Callable

import httpx
import pytest
import uvicorn

FAST = dict(poll_interval=0.1)     # the router's health checks every 100 ms


class Uvicorn:
    """An ASGI app served by uvicorn on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app: Any, lifespan: str = "off") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan=lifespan,
                                                    log_level="critical",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait(lambda: self.server.started, 30, "server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait(pred: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


async def read_body(receive: Any) -> bytes:
    """The whole request body of an ASGI request."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


class Fake:
    """A scripted backend. mode: ok | drop_before (headers, then the connection dies) |
    drop_after (two events, then it dies) | error_first (a stream whose first event is
    an error) | status503."""

    def __init__(self, name: str) -> None:
        self.name, self.mode, self.health, self.metrics = name, "ok", 200, ""
        self.requests: list[dict] = []
        self.auth: list[str] = []
        self.stored: set[str] = set()       # the ids of the responses it created

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = await read_body(receive)
        path = scope["path"]
        if path == "/health":
            return await _send(send, self.health, b"")
        if path == "/metrics":
            return await _send(send, 200, self.metrics.encode(), b"text/plain")
        if path == "/v1/models":
            return await _send(send, 200, json.dumps({"data": [{"id": self.name}]}).encode())
        if path.startswith("/v1/models/"):
            return await _send(send, 200, json.dumps({"id": path[len("/v1/models/"):],
                                                      "backend": self.name}).encode())
        if path.startswith("/v1/responses/"):       # a stored response: only its creator
            rid = path[len("/v1/responses/"):]
            found = rid in self.stored
            return await _send(send, 200 if found else 404, json.dumps(
                {"id": rid, "backend": self.name} if found else {"error": {
                    "message": "no stored response", "type": "x", "param": "response_id",
                    "code": "response_not_found"}}).encode())
        req = json.loads(body)
        if path == "/v1/responses" and self.mode != "status503":
            self.requests.append(req)
            return await self._response(req, send)
        self.requests.append(req)
        self.auth.append(dict(scope["headers"]).get(b"authorization", b"").decode())
        if self.mode == "status503":
            err = {"error": {"message": "overloaded", "type": "x", "param": None,
                             "code": "overloaded"}}
            return await _send(send, 503, json.dumps(err).encode())
        if not req.get("stream"):
            if self.mode == "drop_before":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                raise RuntimeError("scripted drop")
            return await _send(send, 200, json.dumps({"backend": self.name}).encode())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if self.mode == "drop_before":
            raise RuntimeError("scripted drop")
        if self.mode == "error_first":      # what a draining server sends at its deadline
            err = {"error": {"message": "the server is shutting down", "type": "x",
                             "param": None, "code": "shutting_down"}}
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps(err)}\n\n".encode()})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        for i in range(3):
            if self.mode == "drop_after" and i == 2:
                # half an event, then the connection dies
                await send({"type": "http.response.body", "body": b"data: {\"cho",
                            "more_body": True})
                raise RuntimeError("scripted drop")
            event = {"backend": self.name, "choices": [{"text": f"t{i}"}]}
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps(event)}\n\n".encode()})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


    async def _response(self, req: dict, send: Any) -> None:
        """POST /v1/responses: stores an id; a previous_response_id it does not hold is
        a 404; streamed: response.created, two text deltas, response.completed (no
        [DONE]); drop_after: the connection dies after the deltas."""
        prev = req.get("previous_response_id")
        if prev is not None and prev not in self.stored:
            return await _send(send, 404, json.dumps({"error": {
                "message": "no stored response", "type": "x",
                "param": "previous_response_id", "code": "response_not_found"}}).encode())
        rid = f"resp_{self.name}_{len(self.stored)}"
        self.stored.add(rid)
        if not req.get("stream"):
            return await _send(send, 200, json.dumps({"id": rid, "backend": self.name}
                                                     ).encode())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        kinds = ["response.created", "response.output_text.delta",
                 "response.output_text.delta", "response.completed"]
        for seq, kind in enumerate(kinds):
            if self.mode == "drop_after" and kind == "response.completed":
                raise RuntimeError("scripted drop")
            event = {"type": kind, "sequence_number": seq, "response": {"id": rid}}
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def fakes():
    made: list[tuple[Fake, Uvicorn]] = []

    def make(n: int) -> list[tuple[Fake, Uvicorn]]:
        for i in range(n):
            f = Fake(f"b{i}")
            made.append((f, Uvicorn(f)))
        return made[-n:]
    yield make
    for _, srv in made:
        srv.stop()


@pytest.fixture
def router():
    from jaxserve.router import RouterConfig, build_app
    made: list[Uvicorn] = []

    def make(urls: list[str], **kw: Any) -> Uvicorn:
        app = build_app(RouterConfig(backends=urls, **{**FAST, **kw}))
        srv = Uvicorn(app, lifespan="on")
        srv.app = app                       # type: ignore[attr-defined]
        made.append(srv)
        return srv
    yield make
    for srv in made:
        srv.stop()


async def _send(send: Any, status: int, body: bytes, ctype: bytes = b"application/json"
                ) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and
                                                     line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not in /metrics")
