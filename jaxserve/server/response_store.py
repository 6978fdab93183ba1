"""Stored responses of /v1/responses (`store: true`), for GET /v1/responses/{id} and
for continuing a conversation with `previous_response_id`.

In memory and bounded, so a busy server cannot grow without limit: at most
`max_entries` responses (the least recently used go first) and each for `ttl` seconds
after it was last written or read. Entries are scoped by the caller's credentials (a
digest of its Authorization header): a response id alone, even a leaked one, does not
let another key read a response or continue its conversation. Nothing survives a
restart, and data-parallel replicas or routed servers do not share their stores.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]          # the response object as returned
    messages: list[dict[str, Any]]    # the whole conversation as chat messages
    expires: float = 0.0


def scope_of(authorization: str | None) -> str:
    """The store scope of a request's Authorization header (a digest, so no key is
    kept in memory)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


class ResponseStore:
    def __init__(self, max_entries: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """max_entries 0: nothing is stored (every lookup misses)."""
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, scope: str, entry: StoredResponse) -> None:
        if self.max_entries <= 0:
            return
        key = (scope, entry.response["id"])
        with self._lock:
            entry.expires = self.clock() + self.ttl
            self._items[key] = entry
            self._items.move_to_end(key)
            self._expire()
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, scope: str, response_id: str) -> StoredResponse | None:
        """The entry if it exists in this scope and has not expired (it is then the
        most recently used, its time to live restarted)."""
        key = (scope, response_id)
        with self._lock:
            self._expire()
            entry = self._items.get(key)
            if entry is not None:
                entry.expires = self.clock() + self.ttl
                self._items.move_to_end(key)
            return entry

    def _expire(self) -> None:
        """Drop expired entries: the oldest-used come first, so stop at a live one."""
        now = self.clock()
        while self._items:
            key, entry = next(iter(self._items.items()))
            if entry.expires > now:
                return
            del self._items[key]
