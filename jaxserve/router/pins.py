"""Stored responses behind the router: each backend keeps the responses it created
(server/response_store.py) in its own memory, so GET /v1/responses/{id} and a POST
/v1/responses with `previous_response_id` must reach the backend that created that id.

    pins = ResponsePins()
    pins.remember(response)                 # after a POST /v1/responses was forwarded
    pin = pins.backend_of(response_id)      # -> that backend's index, or None

The router learns an id from the answer it relays: a whole response's JSON `id`, or a
stream's first event (response.created, whose `response.id` it is). The map is bounded
(least recently used dropped first) and lives in the router's memory; an id it does not
know (dropped, or created before the router started) is routed as any request is, and
the backend that gets it answers 404 unless it happens to hold it.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from starlette.responses import Response

from jaxserve.router.proxy import BACKEND_HEADER, RelayResponse

DEFAULT_CAPACITY = 65536


class ResponsePins:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, int] = OrderedDict()

    def backend_of(self, response_id: Any) -> int | None:
        if not isinstance(response_id, str):
            return None
        index = self._where.get(response_id)
        if index is not None:
            self._where.move_to_end(response_id)
        return index

    def remember(self, response: Response) -> None:
        """Note which backend created the response this answer carries (nothing when
        it carries none: an error, a response not created)."""
        backend = response.headers.get(BACKEND_HEADER)
        rid = created_id(response)
        if backend is None or rid is None or not backend.isdigit():
            return
        self._where[rid] = int(backend)
        self._where.move_to_end(rid)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)


def created_id(response: Response) -> str | None:
    """The id of the response a 200 answer to POST /v1/responses created."""
    if response.status_code != 200:
        return None
    try:
        if isinstance(response, RelayResponse):
            data = next(line[len(b"data: "):] for line in response.first.splitlines()
                        if line.startswith(b"data: "))
            rid = json.loads(data)["response"]["id"]
        else:
            rid = json.loads(bytes(response.body))["id"]
    except (StopIteration, ValueError, KeyError, TypeError):
        return None
    return rid if isinstance(rid, str) else None
