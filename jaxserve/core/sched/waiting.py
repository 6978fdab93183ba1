"""The waiting queue: FCFS order, front insertion for preempted requests, O(1) removal.

An abort of a waiting request used to rebuild the whole queue (O(n) per abort, so
50k aborts took minutes with no step run). Here removal only forgets the request in an
index; its slot in the deque goes stale and is skipped when it reaches the front.
When stale slots outnumber live ones the deque is rebuilt once, so memory stays
O(live) and every operation is amortized O(1).

A slot is live only if the index maps its id to that very Request object: a request id
that is aborted and then reused by a new request does not revive the old slot.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from jaxserve.request import Request

_COMPACT_MIN = 64      # below this many stale slots, compacting is not worth a rebuild


class WaitingQueue:
    __slots__ = ("_q", "_live")

    def __init__(self) -> None:
        self._q: deque[Request] = deque()
        self._live: dict[str, Request] = {}

    def append(self, request: Request) -> None:
        self._add(request)
        self._q.append(request)

    def appendleft(self, request: Request) -> None:
        self._add(request)
        self._q.appendleft(request)

    def _add(self, request: Request) -> None:
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._live[request.request_id] = request

    def peek(self) -> Request:
        """The oldest live request; IndexError if none."""
        self._drop_stale_front()
        return self._q[0]

    def popleft(self) -> Request:
        self._drop_stale_front()
        request = self._q.popleft()
        del self._live[request.request_id]
        return request

    def remove(self, req_id: str) -> Request | None:
        """Forget a waiting request (O(1)); None if it is not waiting."""
        request = self._live.pop(req_id, None)
        if request is not None and len(self._q) - len(self._live) > max(
                _COMPACT_MIN, len(self._live)):
            self._q = deque(r for r in self._q if self._is_live(r))
        return request

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        """Live requests in scheduling order."""
        return (r for r in self._q if self._is_live(r))

    def _is_live(self, request: Request) -> bool:
        return self._live.get(request.request_id) is request

    def _drop_stale_front(self) -> None:
        q = self._q
        while q and not self._is_live(q[0]):
            q.popleft()
