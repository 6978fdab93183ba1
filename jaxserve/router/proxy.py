"""Forward one request to the backends in the policy's order, streaming included.

    response = await Proxy(pool, policy, metrics).forward("POST", "/v1/completions",
                                                          body, key, stream=True)

Retry rule: a request moves to the next backend only while nothing has reached the
client: the backend refused the connection, dropped it, answered 502/503/504 (dead,
draining, overloaded) or 401 (the router's --backend-api-key), or a stream ended or
sent an error event before its first token. Once the first event is relayed, a failure ends the stream with
an OpenAI error event and `data: [DONE]` (what jaxserve serve itself does when a stream
fails), because re-running the request elsewhere would repeat text the client has.
A read timeout is not retried (the work may be long and would run twice); it is a 504.
When every backend failed: the last backend's 503 (with its Retry-After) if that is how
it failed, else a 502 naming the failure; with no healthy backend at all, a 503.

Streams are relayed event by event (whole `data: ...\\n\\n` blocks, as they arrive),
so a backend that dies mid-event never leaves half an event before the error event.
A Responses API stream (/v1/responses) has no `data: [DONE]`: it ends with its
response.completed (or error) event, and a cut one ends with the Responses `error`
event instead.

`pin` (a backend index) sends a request to that backend only, while it is healthy: the
one holding a stored response the request names (router/pins.py).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.responses import Response, StreamingResponse

from jaxserve.router.backends import Backend, BackendPool
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policies import Policy
from jaxserve.server.errors import APIError

log = logging.getLogger("jaxserve.router")

RETRY_STATUSES = {401, 502, 503, 504}
PASS_HEADERS = ("content-type", "retry-after", "x-request-id")
BACKEND_HEADER = "x-jaxserve-backend"       # which backend (its index in --backend order)
DONE = b"data: [DONE]\n\n"
# the last events of a Responses stream (it sends no [DONE])
RESPONSES_END = (b"event: response.completed", b"event: response.incomplete",
                 b"event: response.failed", b"event: error")


@dataclass(slots=True, eq=False)
class Failure(Exception):
    """One attempt failed before anything reached the client."""
    kind: str                   # metrics.FAILURE_KINDS
    message: str
    mark_down: bool = False
    retry: bool = True
    status: int = 502
    response: Response | None = None    # the backend's own answer, to pass on if last

    def client_response(self) -> Response:
        if self.response is not None and self.status == 503:
            return self.response
        code = "backend_timeout" if self.status == 504 else "backend_failed"
        return APIError(self.status, self.message, code=code,
                        type="service_unavailable").response()


class Proxy:
    def __init__(self, pool: BackendPool, policy: Policy, metrics: RouterMetrics) -> None:
        self.pool, self.policy, self.metrics = pool, policy, metrics

    async def forward(self, method: str, path: str, body: bytes | None, key: str, *,
                      stream: bool = False, pin: int | None = None) -> Response:
        healthy = self.pool.healthy()
        pinned = [b for b in healthy if b.index == pin]
        order = pinned or self.policy.order(healthy, key)
        if not order:
            self.metrics.failed.labels("no_healthy_backend").inc()
            return APIError(503, "no healthy backend: " + self._reasons(),
                            code="no_healthy_backend").response()
        last: Failure | None = None
        for attempt, b in enumerate(order):
            self.metrics.requests.labels(b.url).inc()
            if attempt:
                self.metrics.retries.labels(b.url).inc()
            try:
                if stream:
                    return await self._stream(b, path, body or b"")
                return await self._unary(b, method, path, body)
            except Failure as f:
                self.metrics.failures.labels(b.url, f.kind).inc()
                log.info("backend %s failed (%s): %s", b.url, f.kind, f.message)
                if f.mark_down:
                    self.pool.mark_down(b, f.message)
                last = f
                if not f.retry:
                    break
        assert last is not None
        self.metrics.failed.labels("all_backends_failed").inc()
        return last.client_response()

    def _reasons(self) -> str:
        return "; ".join(f"{b.url}: {b.reason or 'down'}" for b in self.pool.backends)

    async def _unary(self, b: Backend, method: str, path: str, body: bytes | None
                     ) -> Response:
        import httpx
        b.inflight += 1
        try:
            r = await self.pool.client.request(method, b.url + path, content=body,
                                               headers=self._headers(body))
        except httpx.HTTPError as e:
            raise _transport_failure(b, e) from None
        finally:
            b.inflight -= 1
        _check_status(b, r.status_code, r.content, r.headers)
        return Response(r.content, status_code=r.status_code, headers=_pass(r.headers, b))

    async def _stream(self, b: Backend, path: str, body: bytes) -> Response:
        import httpx
        b.inflight += 1
        r = None
        try:
            r = await self.pool.client.send(self.pool.client.build_request(
                "POST", b.url + path, content=body, headers=self._headers(body)), stream=True)
            if r.status_code != 200:
                content = await r.aread()
                _check_status(b, r.status_code, content, r.headers)
                raise _Passthrough(Response(content, status_code=r.status_code,
                                            headers=_pass(r.headers, b)))
            events = _events(r.aiter_raw())
            first = await anext(events, None)
        except httpx.HTTPError as e:
            await _close(r, b)
            raise _transport_failure(b, e) from None
        except _Passthrough as p:
            await _close(r, b)
            return p.response
        except BaseException:
            await _close(r, b)
            raise
        if first is None:
            await _close(r, b)
            raise Failure("disconnect", f"{b.url} ended the stream before its first event",
                          mark_down=True)
        if first.startswith((b'data: {"error"', b"event: error")):
            # Failed before any token (e.g. a draining or dying server): the client has
            # nothing yet, so another backend may still serve it.
            await _close(r, b)
            raise Failure("status", f"{b.url} failed the stream before its first token: "
                                    f"{_error_message(first)}")
        return RelayResponse(self._relay(b, path, first, events), r, b,
                             headers=_pass(r.headers, b), first=first)

    async def _relay(self, b: Backend, path: str, first: bytes,
                     events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        import httpx
        done, last = _ended(first), first
        yield first
        error = ""
        try:
            async for block in events:
                done, last = done or _ended(block), block
                yield block
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not isinstance(e, httpx.TimeoutException):
                self.pool.mark_down(b, f"stream cut: {error}")
        if done:
            return
        self.metrics.failures.labels(b.url, "mid_stream").inc()
        self.metrics.failed.labels("stream_cut").inc()
        msg = f"the backend failed after the stream started ({error or 'it ended early'})"
        if path.startswith("/v1/responses"):
            yield _responses_error(msg, last)
            return
        body = APIError(502, msg, code="backend_failed", type="service_unavailable").body()
        yield f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
        yield DONE

    def _headers(self, body: bytes | None) -> dict[str, str]:
        h = dict(self.pool.headers)
        if body is not None:
            h["Content-Type"] = "application/json"
        return h


class _Passthrough(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


class RelayResponse(StreamingResponse):
    """Closes the backend response (so the backend aborts the request and frees its KV
    blocks) and returns the in-flight slot however the client side ends: finished,
    disconnected, or never started."""

    def __init__(self, gen: AsyncIterator[bytes], upstream: Any, b: Backend,
                 headers: dict[str, str], first: bytes = b"") -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={**headers, "cache-control": "no-cache",
                                  "x-accel-buffering": "no"})
        self.upstream, self.backend, self.closed = upstream, b, False
        self.first = first              # the first event block (router/pins.py reads it)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.closed:
                self.closed = True
                await _close(self.upstream, self.backend)


async def _events(raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Raw bytes -> blocks of whole SSE events (each ends with a blank line)."""
    buf = b""
    async for chunk in raw:
        buf += chunk
        cut = buf.rfind(b"\n\n")
        if cut >= 0:
            yield buf[:cut + 2]
            buf = buf[cut + 2:]


def _ended(block: bytes) -> bool:
    """The block holds a stream's own last event."""
    return DONE in block or any(end in block for end in RESPONSES_END)


def _responses_error(message: str, last: bytes) -> bytes:
    """The Responses `error` event, numbered after the last event relayed."""
    seqs = re.findall(rb'"sequence_number":\s*(\d+)', last)
    event = {"type": "error", "sequence_number": int(seqs[-1]) + 1 if seqs else 0,
             "code": "backend_failed", "message": message, "param": None}
    return f"event: error\ndata: {json.dumps(event)}\n\n".encode()


async def _close(r: Any, b: Backend) -> None:
    b.inflight -= 1
    if r is not None:
        try:
            await r.aclose()
        except Exception:       # noqa: BLE001 - closing a broken connection may raise
            pass


def _transport_failure(b: Backend, e: Exception) -> Failure:
    import httpx
    what = f"{b.url}: {type(e).__name__}: {e}" if str(e) else f"{b.url}: {type(e).__name__}"
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return Failure("connect", f"cannot connect to {what}", mark_down=True)
    if isinstance(e, httpx.PoolTimeout):
        return Failure("timeout", f"no free connection to {what}")
    if isinstance(e, httpx.TimeoutException):
        return Failure("timeout", f"no answer in time from {what}", retry=False, status=504)
    return Failure("disconnect", f"lost the connection to {what}", mark_down=True)


def _error_message(block: bytes) -> str:
    try:
        return str(json.loads(block.split(b"\n\n", 1)[0][6:])["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return repr(block[:300])


def _check_status(b: Backend, status: int, content: bytes, headers: Any) -> None:
    """Raise Failure for an answer another backend may do better with."""
    if status not in RETRY_STATUSES:
        return
    if status == 401:
        raise Failure("status", f"{b.url} refused the router's key (--backend-api-key)")
    raise Failure("status", f"{b.url} answered {status}: {content[:300]!r}", status=status,
                  response=Response(content, status_code=status, headers=_pass(headers, b)))


def _pass(headers: Any, b: Backend) -> dict[str, str]:
    out = {k: headers[k] for k in PASS_HEADERS if k in headers}
    out[BACKEND_HEADER] = str(b.index)
    return out
