"""AsyncEngine: the server's side of the engine (submit, stream, abort, health).

The engine loop runs in one background thread; the asyncio event loop only enqueues
commands and awaits per-request queues:

    event loop (HTTP)                       engine thread (sole owner of EngineCore)
    generate() --_Add-->  commands  --->    drain: add / abort / call
    abort()    --_Abort-> (SimpleQueue)     step(): schedule -> execute -> update
    await stream.queue  <--call_soon_threadsafe--  outputs of this step (one call)

Only the engine thread touches EngineCore, the OutputProcessor and `_live`, so none of
them needs a lock. RequestOutputs are cumulative, so a slow consumer simply skips to
the newest one (no unbounded backlog per request). docs/serving.md says why a thread
and not the event loop itself: a step holds the GIL only for its host work and
releases it while XLA runs, so HTTP keeps being served during steps.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from jaxserve.engine.client import EngineClient, EngineSnapshot
from jaxserve.engine.input_processor import InputLimits, InputProcessor
from jaxserve.engine.llm import child_params
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.request import FinishReason, Request, RequestOutput
from jaxserve.sampling.params import SamplingParams

log = logging.getLogger("jaxserve")


class EngineDeadError(RuntimeError):
    """The engine loop died; every open and future request fails with this."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class MetricsSink(Protocol):
    """Called on the engine thread once per finished request (see server/metrics.py)."""

    def observe_request(self, *, prompt_tokens: int, generation_tokens: int,
                        finish_reasons: list[str], ttft: float | None,
                        itls: list[float], e2e: float) -> None: ...


@dataclass(slots=True)
class _Stream:
    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0
    itls: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Add:
    stream: _Stream
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None
    cache_salt: str | None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class _Stop:
    pass


class AsyncEngine:
    def __init__(self, core: EngineClient, tokenizer: Any, *, max_n: int = 16, max_logprobs: int = 20,
                 metrics: MetricsSink | None = None, limits: InputLimits | None = None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.max_n = max_n
        self.max_logprobs = max_logprobs
        self.vocab_size: int = core.model_cfg.vocab_size
        self.max_model_len: int = core.max_model_len
        # Request intake shared with LLM: every add_request goes through it.
        self.inputs = InputProcessor(
            limits or InputLimits(max_n=max_n, max_logprobs=max_logprobs),
            vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        # Written by the engine thread after each step / command batch; /metrics reads it
        # without touching the engine (EngineClient is not thread-safe).
        self._snap: EngineSnapshot = core.snapshot()
        self.metrics = metrics
        self.errored = False
        self.error: str | None = None
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()       # orders errored/accepting against submissions
        self._live: dict[str, _Stream] = {}  # engine thread only
        self._num_open = 0                  # event loop only: generate() calls in flight
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- event-loop side ----------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    prompt_text: str | None = None, cache_salt: str | None = None
                    ) -> "RequestStream":
        """Submit now; raises SamplingParamsError / ValueError for a bad request here, and
        the stream raises ValueError first thing if the engine refuses it (it can never
        fit), EngineDeadError if the engine dies."""
        params = self._checked(prompt_ids, params)
        loop = asyncio.get_running_loop()
        st = _Stream(request_id, asyncio.Queue(), loop, time.monotonic(), len(prompt_ids))
        self._submit(_Add(st, list(prompt_ids), params, prompt_text, cache_salt))
        self._num_open += 1
        return RequestStream(self, st)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative RequestOutputs until finished. Leaving early (break,
        cancellation, client gone) aborts the request and frees its KV blocks."""
        stream = self.add_request(prompt_ids, params, request_id, prompt_text, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (all its n samples) and free its KV blocks. Idempotent."""
        if not self.errored:
            self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[EngineClient], Any]) -> Any:
        """Run fn(core) on the engine thread between steps (admin operations)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(_Call(lambda: fn(self.core), fut, loop))
        return await fut

    def check_health(self) -> None:
        if self.errored or not self._thread.is_alive():
            raise EngineDeadError(self.error or "the engine thread is not running")

    @property
    def num_open_requests(self) -> int:
        return self._num_open

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges for /metrics: the engine thread's latest snapshot."""
        return {**self._snap.as_dict(), "errored": self.errored}

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting; let open requests finish for up to `timeout` s; abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._num_open and time.monotonic() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        if self._num_open:
            log.warning("shutdown: aborting %d unfinished request(s)", self._num_open)
        self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)

    def _checked(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Defaults filled, then the final values checked (engine/input_processor.py)."""
        return self.inputs.process(prompt_ids, params)[1]

    def _submit(self, cmd: Any) -> None:
        with self._lock:
            if self.errored:
                raise EngineDeadError(self.error or "the engine is dead")
            if not self.accepting and isinstance(cmd, _Add):
                raise EngineStoppedError("the server is shutting down")
            self._commands.put(cmd)

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self.core.has_unfinished_requests()):
                if self.core.has_unfinished_requests():
                    self._step()
                self._snap = self.core.snapshot()
        except BaseException as e:      # noqa: BLE001 - any failure kills the engine
            log.exception("engine loop died")
            self._die(f"engine loop died: {type(e).__name__}: {e}")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False when told to stop."""
        try:
            cmd = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                for rid in list(self._live):
                    self._abort(rid)
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _Call):
                self._call(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        st, rid = cmd.stream, cmd.stream.request_id
        if rid in self._live:
            _deliver(st, ValueError(f"duplicate request id {rid!r}"))
            return
        kids = {f"{rid}-{i}": p for i, p in enumerate(child_params(cmd.params))}
        reqs = [Request(cid, cmd.prompt_ids, p, cache_salt=cmd.cache_salt,
                        prompt=cmd.prompt_text, arrival_time=st.arrival)
                for cid, p in kids.items()]
        added: list[str] = []
        try:
            for r in reqs:
                self.core.add_request(r)
                added.append(r.request_id)
        except ValueError as e:
            self.core.abort_requests(added)
            _deliver(st, e)
            return
        self.processor.add_request(rid, cmd.prompt_text, cmd.prompt_ids, kids, reqs[0].metrics)
        self._live[rid] = st

    def _abort(self, rid: str) -> None:
        st = self._live.pop(rid, None)
        if st is None:
            return
        self.core.abort_requests(self.processor.child_ids(rid))
        out = self.processor.abort(rid)
        if out is not None:
            self._finished(st, out, time.monotonic())
            _deliver(st, out)

    def _call(self, cmd: _Call) -> None:
        try:
            res: Any = cmd.fn()
            ok = True
        except Exception as e:          # noqa: BLE001 - handed back to the caller
            res, ok = e, False
        cmd.loop.call_soon_threadsafe(_settle, cmd.future, res, ok)

    def _step(self) -> None:
        outputs, stopped = self.processor.process(self.core.step())
        if stopped:
            self.core.finish_requests(stopped, FinishReason.STOP)
        now = time.monotonic()
        batch: list[tuple[_Stream, Any]] = []
        for out in outputs:
            st = self._live.get(out.request_id)
            if st is None:
                continue
            self._timing(st, out, now)
            if out.finished:
                del self._live[out.request_id]
                self._finished(st, out, now)
            batch.append((st, out))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for st, out in batch:
            by_loop.setdefault(st.loop, []).append((st, out))
        for loop, items in by_loop.items():     # one wake-up per loop per step
            loop.call_soon_threadsafe(_deliver_many, items)

    def _timing(self, st: _Stream, out: RequestOutput, now: float) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        if n > st.num_tokens:
            if st.first_token_time is None:
                st.first_token_time = now
            elif st.last_token_time is not None:
                st.itls.append(now - st.last_token_time)
            st.last_token_time = now
            st.num_tokens = n

    def _finished(self, st: _Stream, out: RequestOutput, now: float) -> None:
        if self.metrics is None:
            return
        ttft = None if st.first_token_time is None else st.first_token_time - st.arrival
        self.metrics.observe_request(
            prompt_tokens=st.num_prompt_tokens, generation_tokens=st.num_tokens,
            finish_reasons=[c.finish_reason or "abort" for c in out.outputs], ttft=ttft,
            itls=st.itls, e2e=now - st.arrival)

    def _die(self, message: str) -> None:
        with self._lock:
            self.errored, self.error = True, message
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        err = EngineDeadError(message)
        for st in list(self._live.values()):
            _deliver(st, err)
        self._live.clear()
        for cmd in pending:
            if isinstance(cmd, _Add):
                _deliver(cmd.stream, err)
            elif isinstance(cmd, _Call):
                cmd.loop.call_soon_threadsafe(_settle, cmd.future, err, False)


class RequestStream:
    """The per-request end of the pipe (event-loop side). close() aborts if unfinished."""

    def __init__(self, engine: AsyncEngine, st: _Stream) -> None:
        self.engine, self.st = engine, st
        self.finished = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.st.request_id

    async def next(self) -> RequestOutput:
        assert not self.finished, "stream already finished"
        q = self.st.queue
        item = await q.get()
        while not q.empty() and not isinstance(item, BaseException):
            item = q.get_nowait()           # cumulative: the newest one is enough
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
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
            self.engine._num_open -= 1


def _deliver(st: _Stream, item: Any) -> None:
    st.loop.call_soon_threadsafe(st.queue.put_nowait, item)


def _deliver_many(batch: list[tuple[_Stream, Any]]) -> None:
    for st, item in batch:
        st.queue.put_nowait(item)


def _settle(fut: asyncio.Future, res: Any, ok: bool) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(res)
    else:
        fut.set_exception(res)
