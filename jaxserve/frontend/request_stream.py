"""The per-request pipe from the engine thread to the event loop: a one-slot mailbox.

A reader only ever needs one item: the newest CUMULATIVE output (it holds all the
earlier ones), the one FINAL_ONLY output, or, for DELTA, all the deltas it has not read
merged into one. So the engine thread overwrites (or, for DELTA, merges into) the slot
each step instead of enqueuing, and a reader that falls behind (a slow SSE client)
holds O(T*n) per request, never one output per step (O(T^2*n) when cumulative). An
exception is kept beside the slot and is sticky: the output produced before the failure
is read first, then the exception, and nothing overwrites the reason a request failed.

    engine thread: box.put(out) -> True when the reader needs a wake-up; the caller
                   then schedules box.wake() on the loop (batched: one call per step)
    event loop:    await box.get()  -> the newest item (DELTA: the merged deltas)
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

from jaxserve.request import RequestOutput


class PendingDeltas:
    """DELTA outputs not read yet, merged into the first one: token ids and logprobs
    are appended to its lists, text pieces collected and joined once when read, so a
    backlog of k steps costs O(new tokens) per step and O(k) memory."""
    __slots__ = ("out", "texts")

    def __init__(self, out: RequestOutput) -> None:
        self.out = out
        self.texts: dict[int, list[str]] = {c.index: [c.text] for c in out.outputs}

    def add(self, new: RequestOutput) -> None:
        mine = {c.index: c for c in self.out.outputs}
        for c in new.outputs:
            old = mine.get(c.index)
            if old is None:
                self.out.outputs.append(c)
                self.texts[c.index] = [c.text]
                continue
            self.texts[c.index].append(c.text)
            old.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if old.logprobs is None:
                    old.logprobs = []
                old.logprobs.extend(c.logprobs)
            old.cumulative_logprob = c.cumulative_logprob
            if c.finish_reason is not None:
                old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
        o = self.out
        o.finished, o.error = new.finished, new.error or o.error
        o.num_cached_tokens, o.metrics = new.num_cached_tokens, new.metrics

    def take(self) -> RequestOutput:
        for c in self.out.outputs:
            parts = self.texts[c.index]
            c.text = parts[0] if len(parts) == 1 else "".join(parts)
        self.out.outputs.sort(key=lambda c: c.index)
        return self.out


class Mailbox:
    __slots__ = ("_item", "_error", "_lock", "_event", "_wake_pending", "_merge")

    def __init__(self, merge: bool = False) -> None:
        """merge: the items are DELTA RequestOutputs (merged, not replaced)."""
        self._item: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._event = asyncio.Event()
        self._wake_pending = False
        self._merge = merge

    def put(self, item: Any) -> bool:
        """Any thread. Replace (DELTA: merge into) the slot's content; True if a wake()
        must be scheduled."""
        with self._lock:
            if self._error is not None:
                return False
            cur = self._item
            if isinstance(item, BaseException):
                self._error = item
            elif not self._merge:
                self._item = item
            elif isinstance(cur, PendingDeltas):
                cur.add(item)
            else:
                self._item = PendingDeltas(item)
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
                error = self._error
            if isinstance(item, PendingDeltas):
                return item.take()      # out of the slot: the engine no longer adds to it
            if item is not None:
                return item
            if error is not None:
                return error            # sticky: every later get() raises it again
            # Clearing before waiting cannot lose a wake-up: wake() runs on this loop,
            # so it cannot run between the take above and this clear.
            self._event.clear()
            await self._event.wait()

    def __len__(self) -> int:
        return 0 if self._item is None and self._error is None else 1


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
    reasons: dict[int, str] = field(default_factory=dict)   # sample index -> finish reason
    max_tokens: int | None = None       # the request's max_tokens (defaults filled)
    seq_tokens: dict[str, int] = field(default_factory=dict)  # sample's id -> its tokens


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
