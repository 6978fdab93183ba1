"""EngineLoop: the engine thread, sole owner of the EngineClient and OutputProcessor.

    loop = EngineLoop(core, processor)      # starts the thread
    loop.submit(AddRequest(...))            # any thread; raises if the engine cannot take it
    loop.abort(rid); loop.stop(); loop.join(5.0)

The thread applies queued commands between steps (add / abort / call / fail-all /
stop), steps while anything is unfinished, and puts each step's outputs in the
requests' mailboxes (frontend/request_stream.py), one event-loop wake-up per step.
Only this thread touches the core, the processor and `live`, so none needs a lock;
`lock` only orders `errored` / `stopping` against submissions from other threads.

Failures: one request's failure (refused by the engine, its output processing raises)
fails that request only (RequestFailedError, with the reason); a failure of the step
itself kills the engine (EngineDeadError for every open and queued request, `dead` set).

Heartbeat: the thread stamps `heartbeat` (monotonic time, what it is starting) at every
turn of its loop and before every command and step, so a watchdog on another thread can
tell a loop that turns from one stuck anywhere (a step, an add_request, an admin call).
Waiting for work is a turn too: the idle wait wakes every `idle_wait` s to stamp, so an
idle engine is alive because its thread demonstrably runs, not by exemption.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from jaxserve.core.client import EngineClient, EngineSnapshot
from jaxserve.frontend.errors import EngineDeadError, EngineStoppedError, RequestFailedError
from jaxserve.frontend.llm import child_params
from jaxserve.frontend.output_processor import OutputProcessor
from jaxserve.frontend.request_stream import Stream, deliver, deliver_many
from jaxserve.request import FinishReason, Request, RequestOutput
from jaxserve.sampling.params import SamplingParams

log = logging.getLogger("jaxserve")


class MetricsSink(Protocol):
    """Called on the engine thread once per finished request (see server/metrics.py).
    A sink may also have `observe_step(num_tokens)`: then it is called after every
    step that computed tokens, with their number (prompt chunks and decode rows)."""

    def observe_request(self, *, prompt_tokens: int, generation_tokens: int,
                        finish_reasons: list[str], ttft: float | None,
                        itls: list[float], e2e: float,
                        queue_time: float | None = None, n: int = 1,
                        max_tokens: int | None = None,
                        max_seq_tokens: int = 0) -> None: ...


# ---- commands (queued by any thread, applied by the engine thread between steps) ------
@dataclass(slots=True)
class AddRequest:
    stream: Stream
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None
    cache_salt: str | None
    lora: Any = None                # the loaded LoRA adapter (jaxserve/lora.py) or None
    lora_name: str | None = None


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class CallOnEngine:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class FailAll:
    error: BaseException          # end every open request with this (drain deadline)


class Stop:
    pass


class EngineLoop:
    def __init__(self, core: EngineClient, processor: OutputProcessor, *,
                 idle_wait: float = 0.5) -> None:
        self.core = core
        self.processor = processor
        self.metrics: MetricsSink | None = None
        # Written after each step / command batch; /metrics reads it without touching
        # the engine (EngineClient is not thread-safe).
        self.snapshot: EngineSnapshot = core.snapshot()
        self.errored = False
        self.error: str | None = None
        self.stopping = False               # Stop queued: nothing else may be
        self.dead = threading.Event()       # set when the loop has died
        # One tuple, replaced whole, so a reader never pairs a time with another
        # turn's activity.
        self.heartbeat: tuple[float, str] = (time.monotonic(), "starting")
        self.idle_wait = idle_wait
        self.lock = threading.Lock()
        self.live: dict[str, Stream] = {}   # engine thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self.thread.start()

    # ---- any thread ---------------------------------------------------------------------
    def submit(self, cmd: Any) -> None:
        """Queue a command; EngineDeadError / EngineStoppedError if it would never run."""
        with self.lock:
            self._check_open()
            self._commands.put(cmd)

    def check_open(self) -> None:
        """Raise what submit() would raise now, queueing nothing."""
        with self.lock:
            self._check_open()

    def _check_open(self) -> None:
        if self.errored:
            raise EngineDeadError(self.error or "the engine is dead")
        if self.stopping:
            raise EngineStoppedError("the engine has stopped")
        if not self.thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    def abort(self, request_id: str) -> None:
        """Idempotent; a no-op once the engine has stopped or died."""
        with self.lock:
            if not (self.errored or self.stopping):
                self._commands.put(AbortRequest(request_id))

    def stop(self) -> None:
        """Fail what is open with EngineStoppedError and end the thread (idempotent)."""
        with self.lock:
            if not self.stopping:
                self.stopping = True
                self._commands.put(Stop())

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def is_dead(self) -> bool:
        return self.errored or not self.thread.is_alive()

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.core.has_unfinished_requests()
                self._beat("commands" if busy else "waiting for work")
                if not self._apply_commands(block=not busy):
                    break
                if self.core.has_unfinished_requests():
                    self._step()
                self.snapshot = self.core.snapshot()
        except BaseException as e:      # noqa: BLE001 - any failure kills the engine
            log.exception("engine loop died")
            self._die(f"engine loop died: {type(e).__name__}: {e}")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False when told to stop."""
        try:
            cmd = (self._commands.get(timeout=self.idle_wait) if block
                   else self._commands.get_nowait())
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Stop):
                self._beat("stopping")
                self._fail_all(EngineStoppedError("the engine has stopped"))
                return False
            if isinstance(cmd, FailAll):
                self._beat("ending requests")
                self._fail_all(cmd.error)
            elif isinstance(cmd, AddRequest):
                self._beat("add_request")
                self._add(cmd)
            elif isinstance(cmd, AbortRequest):
                self._beat("abort")
                self._abort(cmd.request_id)
            elif isinstance(cmd, CallOnEngine):
                self._beat("admin call")
                self._call(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: AddRequest) -> None:
        st, rid = cmd.stream, cmd.stream.request_id
        if rid in self.live:
            deliver(st, ValueError(f"duplicate request id {rid!r}"))
            return
        kids = {f"{rid}-{i}": p for i, p in enumerate(child_params(cmd.params))}
        reqs = [Request(cid, cmd.prompt_ids, p, cache_salt=cmd.cache_salt,
                        prompt=cmd.prompt_text, arrival_time=st.arrival, lora=cmd.lora,
                        lora_name=cmd.lora_name)
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
        self.live[rid] = st

    def _abort(self, rid: str) -> None:
        st = self.live.pop(rid, None)
        if st is None:
            return
        self.core.abort_requests(self.processor.child_ids(rid))
        out = self.processor.abort(rid)
        if out is not None:
            self._finished(st, out, time.monotonic())
            deliver(st, out)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self.live):
            st = self.live.pop(rid)
            self.core.abort_requests(self.processor.child_ids(rid))
            out = self.processor.abort(rid)
            if out is not None:
                self._finished(st, out, time.monotonic())
            deliver(st, error)

    def _fail(self, rid: str, error: Exception) -> None:
        """One request's output processing raised: fail it alone, with the reason."""
        log.error("request %s failed: %s: %s", rid, type(error).__name__, error,
                  exc_info=error)
        st = self.live.pop(rid, None)
        self.core.finish_requests(self.processor.child_ids(rid), FinishReason.ERROR)
        try:
            self.processor.abort(rid)
        except Exception:               # noqa: BLE001 - its state is what broke
            self.processor._drop(rid)
        if st is not None:
            self._observe(st, ["error"], time.monotonic())
            deliver(st, RequestFailedError(f"the request failed while processing its "
                                           f"output: {type(error).__name__}: {error}"))

    def _call(self, cmd: CallOnEngine) -> None:
        if cmd.future.cancelled():      # its caller gave up (engine stalled): run nothing
            return
        try:
            res: Any = cmd.fn()
            ok = True
        except Exception as e:          # noqa: BLE001 - handed back to the caller
            res, ok = e, False
        settle_threadsafe(cmd, res, ok)

    def _beat(self, activity: str) -> None:
        self.heartbeat = (time.monotonic(), activity)

    def _step(self) -> None:
        self._beat("step")
        observe_step = getattr(self.metrics, "observe_step", None)
        before = _tokens_run(self.core) if observe_step is not None else 0
        core_outs = self.core.step()        # raises: an engine failure (caller dies)
        if observe_step is not None:
            ran = _tokens_run(self.core) - before
            if ran:
                observe_step(ran)
        self._beat("output processing")
        outputs, stopped, new_tokens = self._process(core_outs)
        if stopped:
            self.core.finish_requests(stopped, FinishReason.STOP)
        now = time.monotonic()
        for rid, n in new_tokens.items():
            st = self.live.get(rid)
            if st is not None and n:
                _token_timing(st, n, now)
        batch: list[tuple[Stream, Any]] = []
        for out in outputs:
            st = self.live.get(out.request_id)
            if st is None:
                continue
            if out.finished:
                del self.live[out.request_id]
                self._finished(st, out, now)
            batch.append((st, out))
        deliver_many(batch)                 # one wake-up per event loop per step

    def _process(self, core_outs: list[Any]
                 ) -> tuple[list[RequestOutput], list[str], dict[str, int]]:
        """Output processing one user request at a time, so that one that raises (a
        detokenizer or stop-string failure on its state) fails alone. -> outputs, child
        ids stopped by a stop string, new tokens taken per request."""
        groups: dict[str, list[Any]] = {}
        parent_of = self.processor.child_to_parent
        for o in core_outs:
            pid = parent_of.get(o.req_id)
            if pid is not None:
                groups.setdefault(pid, []).append(o)
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        new_tokens: dict[str, int] = {}
        for pid, outs in groups.items():
            # Counted here, not from the outputs: DELTA and FINAL_ONLY ones do not say
            # how many tokens a request has so far.
            n = 0
            st = self.live.get(pid)
            for o in outs:
                if self.processor.is_running(o.req_id):
                    n += len(o.new_token_ids)
                    if st is not None:      # per sample, for the longest one's count
                        st.seq_tokens[o.req_id] = (st.seq_tokens.get(o.req_id, 0)
                                                   + len(o.new_token_ids))
            try:
                got, stop = self.processor.process(outs)
            except Exception as e:      # noqa: BLE001 - this request fails, not the engine
                self._fail(pid, e)
                continue
            outputs += got
            stopped += stop
            new_tokens[pid] = n
        return outputs, stopped, new_tokens

    def _finished(self, st: Stream, out: RequestOutput, now: float) -> None:
        for c in out.outputs:
            if c.finish_reason is not None:
                st.reasons[c.index] = c.finish_reason
        scheduled = out.metrics.first_scheduled_time if out.metrics is not None else None
        self._observe(st, [st.reasons.get(i, "abort") for i in range(st.num_seqs)], now,
                      scheduled)

    def _observe(self, st: Stream, reasons: list[str], now: float,
                 scheduled: float | None = None) -> None:
        if self.metrics is None:
            return
        ttft = None if st.first_token_time is None else st.first_token_time - st.arrival
        self.metrics.observe_request(
            prompt_tokens=st.num_prompt_tokens, generation_tokens=st.num_tokens,
            finish_reasons=reasons, ttft=ttft, itls=st.itls, e2e=now - st.arrival,
            queue_time=None if scheduled is None else max(scheduled - st.arrival, 0.0),
            n=st.num_seqs, max_tokens=st.max_tokens,
            max_seq_tokens=max(st.seq_tokens.values(), default=0))

    def _die(self, message: str) -> None:
        with self.lock:
            self.errored, self.error = True, message
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        err = EngineDeadError(message)
        for st in list(self.live.values()):
            deliver(st, err)
        self.live.clear()
        for cmd in pending:
            if isinstance(cmd, AddRequest):
                deliver(cmd.stream, err)
            elif isinstance(cmd, CallOnEngine):
                settle_threadsafe(cmd, err, False)
        self.dead.set()


def _tokens_run(core: EngineClient) -> int:
    """Tokens the engine's steps have computed so far (prompt and decode rows)."""
    return core.stats.scheduled_tokens


def _token_timing(st: Stream, n: int, now: float) -> None:
    """n new tokens arrived at `now`: TTFT on the first, one ITL per later step."""
    if st.first_token_time is None:
        st.first_token_time = now
    elif st.last_token_time is not None:
        st.itls.append(now - st.last_token_time)
    st.last_token_time = now
    st.num_tokens += n


def settle_threadsafe(cmd: CallOnEngine, res: Any, ok: bool) -> None:
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
