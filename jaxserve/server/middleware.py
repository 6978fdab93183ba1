"""The ASGI gate in front of every route: API key on /v1, body size limit.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and
disconnect messages pass through untouched. The body is read here, bounded by
max_body_bytes whatever Content-Length claims (a chunked upload has none), and
replayed to the app.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from jaxserve.server.errors import APIError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Gate:
    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.key is not None and scope["path"].startswith("/v1"):
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
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _send_error(send, too_big)
                return
            if not msg.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)


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
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
