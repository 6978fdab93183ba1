"""The per-request pipe from the engine thread to the event loop: a one-slot mailbox.

RequestOutputs are cumulative, so a reader only ever needs the newest one. The engine
thread overwrites the slot each step instead of enqueuing, so a reader that falls
behind (a slow SSE client) holds one output per request, not one per step
(O(T*n) memory instead of O(T^2*n)). An exception in the slot is sticky: nothing
overwrites the reason a request failed.

    engine thread: box.put(out) -> True when the reader needs a wake-up; the caller
                   then schedules box.wake() on the loop (batched: one call per step)
    event loop:    await box.get()  -> the newest item, at most once each
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable


class Mailbox:
    __slots__ = ("_item", "_lock", "_event", "_wake_pending")

    def __init__(self) -> None:
        self._item: Any = None
        self._lock = threading.Lock()
        self._event = asyncio.Event()
        self._wake_pending = False

    def put(self, item: Any) -> bool:
        """Any thread. Replace the slot's content; True if a wake() must be scheduled."""
        with self._lock:
            if isinstance(self._item, BaseException):
                return False
            self._item = item
            if self._wake_pending:
                return False
            self._wake_pending = True
            return True

    def wake(self) -> None:
        """Event-loop thread."""
        with self._lock:
            self._wake_pending = False
        self._event.set()

    async def get(self) -> Any:
        """Event-loop thread: wait for an item and take it out of the slot."""
        while True:
            with self._lock:
                item, self._item = self._item, None
            if item is not None:
                return item
            # Clearing before waiting cannot lose a wake-up: wake() runs on this loop,
            # so it cannot run between the take above and this clear.
            self._event.clear()
            await self._event.wait()

    def __len__(self) -> int:
        return 0 if self._item is None else 1


@dataclass(slots=True)
class Stream:
    """Engine-side record of one user request (all its n samples)."""
    request_id: str
    mailbox: Mailbox
    loop: asyncio.AbstractEventLoop
    arrival: float
    num_prompt_tokens: int
    num_seqs: int = 1
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def deliver(st: Stream, item: Any) -> None:
    """Engine thread: put one item and wake its reader if needed."""
    if st.mailbox.put(item):
        _call_soon(st.loop, _wake_all, [st.mailbox])


def deliver_many(batch: Iterable[tuple[Stream, Any]]) -> None:
    """Engine thread: put a step's outputs; one loop wake-up per event loop."""
    wakes: dict[asyncio.AbstractEventLoop, list[Mailbox]] = {}
    for st, item in batch:
        if st.mailbox.put(item):
            wakes.setdefault(st.loop, []).append(st.mailbox)
    for loop, boxes in wakes.items():
        _call_soon(loop, _wake_all, boxes)


def _wake_all(boxes: list[Mailbox]) -> None:
    for box in boxes:
        box.wake()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:        # the loop is closed: nobody is left to read the output
        pass


class RequestStream:
    """The per-request end of the pipe (event-loop side). close() aborts if unfinished."""

    def __init__(self, engine: Any, st: Stream) -> None:
        self.engine, self.st = engine, st
        self.finished = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.st.request_id

    async def next(self) -> Any:
        assert not self.finished, "stream already finished"
        item = await self.st.mailbox.get()
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        return await self.next()

    def close(self) -> None:
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if abort and not self.finished:
            self.engine.abort(self.st.request_id)
        self.finished = True
        if not self._closed:
            self._closed = True
            self.engine._stream_closed(self.st)
