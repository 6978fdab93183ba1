"""AsyncEngine: the server's side of the engine (submit, stream, abort, health).

The engine loop runs in one background thread; the asyncio event loop only enqueues
commands and awaits per-request queues:

    event loop (HTTP)                       engine thread (sole owner of EngineCore)
    generate() --_Add-->  commands  --->    drain: add / abort / call
    abort()    --_Abort-> (SimpleQueue)     step(): schedule -> execute -> update
    await stream.mailbox  <--call_soon_threadsafe--  outputs of this step (one call)

Only the engine thread touches EngineCore, the OutputProcessor and `_live`, so none of
them needs a lock. RequestOutputs are cumulative and each request has a one-slot
mailbox (engine/request_stream.py), so a slow consumer skips to the newest one and
holds one output, never a backlog. docs/serving.md says why a thread and not the event
loop itself: a step holds the GIL only for its host work and releases it while XLA
runs, so HTTP keeps being served during steps.

Failures: one request's failure (refused by the engine, its output processing raises)
fails that request only (RequestFailedError, with the reason); a failure of the step
itself kills the engine (EngineDeadError for everyone, `dead` is set). A step running
longer than `step_timeout` makes check_health() raise EngineStalledError.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from jaxserve.engine.client import EngineClient, EngineSnapshot
from jaxserve.engine.input_processor import InputLimits, InputProcessor
from jaxserve.engine.llm import child_params
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request_stream import Mailbox, RequestStream, deliver, deliver_many
from jaxserve.engine.request_stream import Stream as _Stream
from jaxserve.request import FinishReason, Request, RequestOutput
from jaxserve.sampling.params import SamplingParams

log = logging.getLogger("jaxserve")


class EngineDeadError(RuntimeError):
    """The engine loop died; every open and future request fails with this."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or stopped): no new requests or admin calls."""


class EngineStalledError(EngineDeadError):
    """One engine step has run longer than step_timeout (the engine may recover)."""


class EngineOverloadedError(RuntimeError):
    """Admission control: too many sequences are already admitted; retry later."""


class RequestFailedError(RuntimeError):
    """This request failed on the engine thread (the reason is the message); the
    engine and every other request carry on."""


class MetricsSink(Protocol):
    """Called on the engine thread once per finished request (see server/metrics.py)."""

    def observe_request(self, *, prompt_tokens: int, generation_tokens: int,
                        finish_reasons: list[str], ttft: float | None,
                        itls: list[float], e2e: float) -> None: ...


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


@dataclass(slots=True)
class _FailAll:
    error: BaseException          # end every open request with this (drain deadline)


class _Stop:
    pass


class AsyncEngine:
    def __init__(self, core: EngineClient, tokenizer: Any, *, max_n: int = 16, max_logprobs: int = 20,
                 metrics: MetricsSink | None = None, limits: InputLimits | None = None,
                 step_timeout: float = 300.0, max_open_seqs: int | None = None) -> None:
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
        self.stopping = False               # _Stop sent: nothing else may be queued
        self.dead = threading.Event()       # set when the engine loop has died
        self.step_timeout = step_timeout
        self.max_open_seqs = max_open_seqs  # admission bound (None: unbounded)
        self._step_started: float | None = None   # monotonic start of the running step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()       # orders errored/stopping against submissions
        self._live: dict[str, _Stream] = {}  # engine thread only
        self._num_open = 0                  # event loop only: generate() calls in flight
        self._num_open_seqs = 0             # event loop only: their sequences (n each)
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
        st = _Stream(request_id, Mailbox(), loop, time.monotonic(), len(prompt_ids),
                     params.n)
        self._submit(_Add(st, list(prompt_ids), params, prompt_text, cache_salt))
        self._num_open += 1
        self._num_open_seqs += st.num_seqs
        return RequestStream(self, st)

    def admit(self, num_seqs: int) -> None:
        """Admission control, before submitting a request of num_seqs sequences: raises
        EngineOverloadedError when it would exceed max_open_seqs (a request that alone
        exceeds it is still let in when nothing else is open, so it can ever run)."""
        limit = self.max_open_seqs
        if limit is not None and self._num_open_seqs and \
                self._num_open_seqs + num_seqs > limit:
            raise EngineOverloadedError(
                f"the server is at capacity ({self._num_open_seqs} sequences admitted, "
                f"limit {limit}); retry later")

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
        """Abort a request (all its n samples) and free its KV blocks. Idempotent; a
        no-op once the engine has stopped or died (their requests are gone already)."""
        with self._lock:
            if not (self.errored or self.stopping):
                self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[EngineClient], Any]) -> Any:
        """Run fn(core) on the engine thread between steps (admin operations). Raises
        EngineStoppedError / EngineDeadError at once if the engine cannot run it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(_Call(lambda: fn(self.core), fut, loop))
        return await fut

    def check_health(self) -> None:
        if self.errored or not self._thread.is_alive():
            raise EngineDeadError(self.error or "the engine thread is not running")
        started = self._step_started
        if started is not None and time.monotonic() - started > self.step_timeout:
            raise EngineStalledError(f"an engine step has been running for "
                                     f"{time.monotonic() - started:.0f} s (step timeout "
                                     f"{self.step_timeout:g} s)")

    def is_dead(self) -> bool:
        """The engine loop died (or its thread is gone): it will never step again."""
        return self.errored or not self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        try:
            self.check_health()
        except EngineDeadError:
            return False
        return True

    @property
    def num_open_requests(self) -> int:
        return self._num_open

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges for /metrics: the engine thread's latest snapshot."""
        return {**self._snap.as_dict(), "errored": not self.healthy}

    async def drain(self, timeout: float) -> int:
        """Stop accepting; let open requests finish for up to `timeout` s; end the rest
        with EngineStoppedError (a stream sends it as an error event, then [DONE]) and
        give their readers up to a second to pick it up. -> requests ended early."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._num_open and time.monotonic() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        left = self._num_open
        if left and not self.errored:
            log.warning("shutdown: ending %d unfinished request(s)", left)
            with contextlib.suppress(EngineDeadError, EngineStoppedError):
                self._submit(_FailAll(EngineStoppedError(
                    f"the server is shutting down; the request did not finish within "
                    f"the {timeout:g} s drain time")))
            deadline = time.monotonic() + 1.0
            while self._num_open and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        return left

    async def shutdown(self, timeout: float) -> None:
        """drain(timeout), then stop the engine thread. Later calls fail fast."""
        await self.drain(timeout)
        with self._lock:
            if not self.stopping:
                self.stopping = True
                self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)

    def _checked(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Defaults filled, then the final values checked (engine/input_processor.py)."""
        return self.inputs.process(prompt_ids, params)[1]

    def _submit(self, cmd: Any) -> None:
        with self._lock:
            if self.errored:
                raise EngineDeadError(self.error or "the engine is dead")
            if self.stopping:
                raise EngineStoppedError("the engine has stopped")
            if not self.accepting and isinstance(cmd, _Add):
                raise EngineStoppedError("the server is shutting down")
            if not self._thread.is_alive():
                raise EngineDeadError("the engine thread is not running")
            self._commands.put(cmd)

    def _stream_closed(self, st: _Stream) -> None:
        self._num_open -= 1
        self._num_open_seqs -= st.num_seqs

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
                self._fail_all(EngineStoppedError("the engine has stopped"))
                return False
            if isinstance(cmd, _FailAll):
                self._fail_all(cmd.error)
            elif isinstance(cmd, _Add):
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
            deliver(st, ValueError(f"duplicate request id {rid!r}"))
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
            self.processor.add_request(rid, cmd.prompt_text, cmd.prompt_ids, kids,
                                       reqs[0].metrics)
        except Exception as e:          # noqa: BLE001 - this request fails, not the engine
            self.core.abort_requests(added)
            self.processor.abort(rid)
            if not isinstance(e, ValueError):
                log.exception("request %s failed on admission", rid)
                e = RequestFailedError(f"the engine could not admit the request: "
                                       f"{type(e).__name__}: {e}")
            deliver(st, e)
            return
        self._live[rid] = st

    def _abort(self, rid: str) -> None:
        st = self._live.pop(rid, None)
        if st is None:
            return
        self.core.abort_requests(self.processor.child_ids(rid))
        out = self.processor.abort(rid)
        if out is not None:
            self._finished(st, out, time.monotonic())
            deliver(st, out)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._live):
            st = self._live.pop(rid)
            self.core.abort_requests(self.processor.child_ids(rid))
            out = self.processor.abort(rid)
            if out is not None:
                self._finished(st, out, time.monotonic())
            deliver(st, error)

    def _fail(self, rid: str, error: Exception) -> None:
        """One request's output processing raised: fail it alone, with the reason."""
        log.error("request %s failed: %s: %s", rid, type(error).__name__, error,
                  exc_info=error)
        st = self._live.pop(rid, None)
        self.core.finish_requests(self.processor.child_ids(rid), FinishReason.ERROR)
        try:
            self.processor.abort(rid)
        except Exception:               # noqa: BLE001 - its state is what broke
            self.processor._drop(rid)
        if st is not None:
            self._observe(st, ["error"], time.monotonic())
            deliver(st, RequestFailedError(f"the request failed while processing its "
                                           f"output: {type(error).__name__}: {error}"))

    def _call(self, cmd: _Call) -> None:
        try:
            res: Any = cmd.fn()
            ok = True
        except Exception as e:          # noqa: BLE001 - handed back to the caller
            res, ok = e, False
        _settle_threadsafe(cmd, res, ok)

    def _step(self) -> None:
        self._step_started = time.monotonic()
        core_outs = self.core.step()        # raises: an engine failure (caller dies)
        self._step_started = None
        outputs, stopped = self._process(core_outs)
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
        deliver_many(batch)                 # one wake-up per event loop per step

    def _process(self, core_outs: list[Any]) -> tuple[list[RequestOutput], list[str]]:
        """Output processing one user request at a time, so that one that raises (a
        detokenizer or stop-string failure on its state) fails alone."""
        groups: dict[str, list[Any]] = {}
        parent_of = self.processor.child_to_parent
        for o in core_outs:
            pid = parent_of.get(o.req_id)
            if pid is not None:
                groups.setdefault(pid, []).append(o)
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for pid, outs in groups.items():
            try:
                got, stop = self.processor.process(outs)
            except Exception as e:      # noqa: BLE001 - this request fails, not the engine
                self._fail(pid, e)
                continue
            outputs += got
            stopped += stop
        return outputs, stopped

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
        self._observe(st, [c.finish_reason or "abort" for c in out.outputs], now)

    def _observe(self, st: _Stream, reasons: list[str], now: float) -> None:
        if self.metrics is None:
            return
        ttft = None if st.first_token_time is None else st.first_token_time - st.arrival
        self.metrics.observe_request(
            prompt_tokens=st.num_prompt_tokens, generation_tokens=st.num_tokens,
            finish_reasons=reasons, ttft=ttft, itls=st.itls, e2e=now - st.arrival)

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
            deliver(st, err)
        self._live.clear()
        for cmd in pending:
            if isinstance(cmd, _Add):
                deliver(cmd.stream, err)
            elif isinstance(cmd, _Call):
                _settle_threadsafe(cmd, err, False)
        self.dead.set()


def _settle_threadsafe(cmd: _Call, res: Any, ok: bool) -> None:
    try:
        cmd.loop.call_soon_threadsafe(_settle, cmd.future, res, ok)
    except RuntimeError:        # the caller's loop is closed
        pass


def _settle(fut: asyncio.Future, res: Any, ok: bool) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(res)
    else:
        fut.set_exception(res)
