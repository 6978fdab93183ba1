"""Request bodies decoded strictly, for the server's routes and the router.

    value = await decode(body_bytes)     # APIError (400) for a body nobody should send

Refused with a 400 before any route sees the body:
  * bytes that are not valid UTF-8 (JSON between systems must be UTF-8; a surrogate
    encoded in UTF-8 is invalid UTF-8 and caught here);
  * malformed JSON;
  * nesting deeper than MAX_DEPTH (Python's decoder raises RecursionError near 1000
    levels; anything past MAX_DEPTH is no real request and would only feed recursion
    further in: templates, schema compilers, json.dumps);
  * a lone UTF-16 surrogate (`"\\ud800"` as a JSON escape) in any string or key anywhere
    in the body (the error names the field, e.g. `messages.0.content`): no tokenizer or
    UTF-8 encoder accepts one, so it would fail deep inside the server instead of here.

Linear time, and no Python loop over the body's items: the decoder is C; the depth is
a running count of brackets outside strings (a regex and numpy); the surrogate check
runs only when a C regex finds a surrogate escape in the text at all (valid pairs are
joined by the decoder into one character, so only lone ones fail) and is one
serialisation of the value. Bodies over THREAD_BYTES are decoded in a worker thread, so
a large one does not hold the event loop for the whole decode.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Callable, Coroutine

import numpy as np
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.server.errors import APIError

MAX_DEPTH = 64
THREAD_BYTES = 64 * 1024

# A \uD800-\uDFFF escape (a false hit, e.g. an escaped backslash before "ud800", only
# costs the exact check).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


class BodyError(HTTPException):
    """An APIError raised while FastAPI reads the body: FastAPI re-raises HTTPExceptions
    from its body parsing as they are (anything else becomes a bare "error parsing the
    body"), and the app's handler answers with `.error`."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            try:
                self._strict_json = await decode(await self.body())
            except APIError as e:
                raise BodyError(e) from None
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """A FastAPI route whose JSON body goes through `decode` (set as the router's
    route_class before the routes are added)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))
        return route


async def decode(body: bytes) -> Any:
    if len(body) > THREAD_BYTES:
        return await asyncio.to_thread(loads, body)
    return loads(body)


def loads(body: bytes) -> Any:
    """The decoded body; APIError (400) naming the problem."""
    encoding = json.detect_encoding(body)
    try:
        text = body.decode(encoding)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid {e.encoding.upper()}: {e.reason} at "
                            f"byte {e.start}", code="invalid_encoding") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if _deeper_than(MAX_DEPTH, body if encoding.startswith("utf-8") else text.encode()):
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(text) and not _encodable(value):
        raise _lone_surrogate(value)
    return value


def _deeper_than(limit: int, data: bytes) -> bool:
    """Whether valid JSON `data` nests arrays and objects more than `limit` deep: the
    running count of brackets outside strings, in C and numpy (a walk over the decoded
    value in Python costs seconds on a body of a million small lists)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    brackets = np.frombuffer(_STRING.sub(b"", data).translate(None, _NOT_BRACKETS),
                             np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return bool(steps.size) and int(np.cumsum(steps).max()) > limit


def _encodable(value: Any) -> bool:
    """False iff a string or key anywhere in `value` holds a lone surrogate (UTF-8 has
    no encoding for one); one C serialisation of the value."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(value: Any) -> APIError:
    """The error, naming where: down the failing branch a few levels (each level one
    serialisation of what is left, so linear time), e.g. messages.0.content; not into
    a long list (a million prompts would cost a million small serialisations)."""
    path: list[Any] = []
    for _ in range(6):
        items = value.items() if isinstance(value, dict) else \
            enumerate(value) if isinstance(value, list) and len(value) <= 1024 else ()
        for k, v in items:
            if not _encodable(k) or not _encodable(v):
                path.append(k)
                value = v
                break
        else:
            break
    # a key on the path may hold the surrogate: escaped, or the error could not be sent
    names = [str(p).encode("utf-8", "backslashreplace").decode() for p in path]
    return APIError(400, f"{'.'.join(names) or 'body'}: invalid Unicode: a lone UTF-16 "
                         f"surrogate (\\ud800-\\udfff not part of a pair)",
                    param=names[0] if names else None, code="invalid_unicode")


def _too_deep() -> APIError:
    return APIError(400, f"the body is nested too deeply: at most {MAX_DEPTH} levels of "
                         f"arrays and objects", code="too_deeply_nested")
