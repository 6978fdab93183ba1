"""The ASGI gate in front of every route: API key, body size and body time limits.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and
disconnect messages pass through untouched. With an API key, every route except
/health (and /metrics when public_metrics) needs it, compared in constant time. The
body is read here, bounded by max_body_bytes whatever Content-Length claims (a chunked
upload has none) and by body_timeout seconds (a slow upload gets 408), and replayed to
the app.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, Awaitable, Callable

from jaxserve.server.errors import APIError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Gate:
    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int,
                 public_metrics: bool = False, body_timeout: float = 30.0) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.public = {"/health"} | ({"/metrics"} if public_metrics else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.key is not None and scope["path"] not in self.public:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                await _send_error(send, APIError(401, "invalid or missing API key "
                                                      "(Authorization: Bearer KEY)",
                                                 code="invalid_api_key"))
                return
        too_big = APIError(413, f"request body exceeds {self.max_body_bytes} bytes",
                           code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _send_error(send, APIError(400, "invalid Content-Length header"))
                return
            if declared > self.max_body_bytes:
                await _send_error(send, too_big)
                return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except asyncio.TimeoutError:
            await _send_error(send, APIError(
                408, f"the request body was not received within {self.body_timeout:g} s",
                code="request_timeout"))
            return
        if body is None:            # client gone
            return
        if len(body) > self.max_body_bytes:
            await _send_error(send, too_big)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or as soon as it exceeds the limit; None on disconnect."""
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            body += msg.get("body", b"")
            if len(body) > self.max_body_bytes or not msg.get("more_body", False):
                return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()       # after the body: only http.disconnect comes
    return replay


async def _send_error(send: Send, e: APIError) -> None:
    payload = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if e.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if e.status == 408:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
