"""AsyncEngine: the server's side of the engine (submit, stream, abort, health).

The engine loop runs in one background thread (frontend/engine_loop.py); the asyncio
event loop only enqueues commands and awaits per-request mailboxes:

    event loop (HTTP)                       engine thread (EngineLoop: sole owner of the
    generate() --AddRequest-->  commands -->    EngineClient) drain: add / abort / call
    abort()    --AbortRequest-> (queue)         step(): schedule -> execute -> update
    await stream.mailbox  <--call_soon_threadsafe--  outputs of this step (one call)

Each request has a one-slot mailbox (frontend/request_stream.py): CUMULATIVE outputs
replace each other there, DELTA ones are merged, FINAL_ONLY has one; so a slow consumer
holds O(T) per request, never a backlog. docs/serving.md says why a thread and not the
event loop itself: a step holds the GIL only for its host work and releases it while
XLA runs, so HTTP keeps being served during steps.

Failures: one request's failure fails that request only (RequestFailedError); a failure
of the step itself kills the engine (EngineDeadError for everyone).

Watchdog: the engine thread stamps a heartbeat at every turn of its loop (EngineLoop).
When it has not turned for `step_timeout` s, whatever it is stuck in (a step, an
add_request, an admin call), check_health() raises EngineStalledError; call() gives
up with it instead of waiting forever; drain() ends open requests from the event loop
when the engine thread does not; `drained_cleanly` says whether the thread stopped.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

from jaxserve.core.client import EngineClient
from jaxserve.frontend.engine_loop import (AddRequest, CallOnEngine, EngineLoop, FailAll,
                                           MetricsSink)
from jaxserve.frontend.errors import (EngineDeadError, EngineOverloadedError,
                                      EngineStalledError, EngineStoppedError,
                                      RequestFailedError)
from jaxserve.frontend.input_processor import InputLimits, InputProcessor
from jaxserve.frontend.output_processor import OutputProcessor
from jaxserve.frontend.request_stream import Mailbox, RequestStream, deliver
from jaxserve.frontend.request_stream import Stream as _Stream
from jaxserve.request import RequestOutput
from jaxserve.sampling.params import RequestOutputKind, SamplingParams

log = logging.getLogger("jaxserve")

CALL_POLL_SECONDS = 0.1     # how often call() looks at the heartbeat while it waits
STOP_JOIN_SECONDS = 5.0     # shutdown() and close() together wait this long for the thread
WEDGED_JOIN_SECONDS = 0.5   # ... or this long once drain() found the thread unresponsive

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "EngineStalledError",
           "EngineStoppedError", "MetricsSink", "RequestFailedError"]


class AsyncEngine:
    def __init__(self, core: EngineClient, tokenizer: Any, *, max_n: int = 16,
                 max_logprobs: int = 20, metrics: MetricsSink | None = None,
                 limits: InputLimits | None = None, step_timeout: float = 300.0, max_open_seqs: int | None = None) -> None:
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
        self.accepting = True
        self.step_timeout = step_timeout
        self.max_open_seqs = max_open_seqs  # admission bound (None: unbounded)
        self._num_open = 0                  # event loop only: generate() calls in flight
        self._num_open_seqs = 0             # event loop only: their sequences (n each)
        self._released = False              # core.shutdown() called (close())
        # event loop only: the open requests' streams, so drain() can end them itself
        # when the engine thread is too stuck to (keyed by id: Stream is unhashable)
        self._open: dict[int, _Stream] = {}
        self._join_deadline: float | None = None    # set at the first stop
        # Half the shortest allowed step timeout at most: an idle engine stamps its
        # heartbeat well inside any timeout.
        self._engine = EngineLoop(core, self.processor,
                                  idle_wait=min(0.5, step_timeout / 4))
        self._engine.metrics = metrics

    # ---- the engine thread's state, as the server reads it --------------------------------
    @property
    def metrics(self) -> MetricsSink | None:
        return self._engine.metrics

    @metrics.setter
    def metrics(self, sink: MetricsSink | None) -> None:
        self._engine.metrics = sink

    @property
    def errored(self) -> bool:
        return self._engine.errored

    @property
    def error(self) -> str | None:
        return self._engine.error

    @property
    def dead(self) -> threading.Event:
        """Set when the engine loop has died."""
        return self._engine.dead

    @property
    def _thread(self) -> threading.Thread:
        return self._engine.thread

    # ---- event-loop side ----------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    prompt_text: str | None = None, cache_salt: str | None = None,
                    lora: Any = None, lora_name: str | None = None) -> "RequestStream":
        """Submit now; raises SamplingParamsError / ValueError for a bad request here, and
        the stream raises ValueError first thing if the engine refuses it (it can never
        fit), EngineDeadError if the engine dies. lora: a loaded LoRA adapter
        (jaxserve/lora.py), named lora_name."""
        params = self._checked(prompt_ids, params)
        loop = asyncio.get_running_loop()
        box = Mailbox(merge=params.output_kind is RequestOutputKind.DELTA)
        st = _Stream(request_id, box, loop, time.monotonic(), len(prompt_ids), params.n,
                     max_tokens=params.max_tokens)
        self._submit(AddRequest(st, list(prompt_ids), params, prompt_text, cache_salt, lora,
                                lora_name))
        self._open[id(st)] = st
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
        """Stream RequestOutputs until finished, as params.output_kind says: CUMULATIVE
        (each holds everything so far), DELTA (each holds what is new; a consumer that
        falls behind gets the missed deltas merged into one), FINAL_ONLY (one output).
        Leaving early (break, cancellation, client gone) aborts the request and frees
        its KV blocks."""
        stream = self.add_request(prompt_ids, params, request_id, prompt_text, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (all its n samples) and free its KV blocks. Idempotent; a
        no-op once the engine has stopped or died (their requests are gone already)."""
        self._engine.abort(request_id)

    async def call(self, fn: Callable[[EngineClient], Any]) -> Any:
        """Run fn(core) on the engine thread between steps (admin operations). Raises
        EngineStoppedError / EngineDeadError at once if the engine cannot run it, and
        EngineStalledError once the engine loop has not turned for step_timeout s (so
        at most step_timeout s after the call; at once if it is stalled already); fn
        then never runs."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(CallOnEngine(lambda: fn(self.core), fut, loop))
        deadline = time.monotonic() + self.step_timeout
        try:
            while not fut.done():
                self.check_health()
                if time.monotonic() > deadline:     # turns, yet never reaches the call
                    raise EngineStalledError(f"the engine did not run the call within "
                                             f"{self.step_timeout:g} s")
                await asyncio.wait({fut}, timeout=CALL_POLL_SECONDS)
        finally:
            fut.cancel()                # no-op once settled; otherwise the engine skips it
        return fut.result()

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine died, EngineStalledError if its loop has
        not turned for step_timeout s (it may still recover)."""
        if self.is_dead():
            raise EngineDeadError(self.error or "the engine thread is not running")
        quiet, activity = self.stalled_for()
        if quiet > self.step_timeout:
            raise EngineStalledError(f"the engine loop has not turned for {quiet:.0f} s "
                                     f"(busy in {activity}; step timeout "
                                     f"{self.step_timeout:g} s)")

    def stalled_for(self) -> tuple[float, str]:
        """-> seconds since the engine loop last turned, and what it was starting then."""
        at, activity = self._engine.heartbeat
        return time.monotonic() - at, activity

    def is_dead(self) -> bool:
        """The engine loop died (or its thread is gone): it will never step again."""
        return self._engine.is_dead()

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
        return {**self._engine.snapshot.as_dict(), "errored": not self.healthy}

    async def drain(self, timeout: float) -> int:
        """Stop accepting; let open requests finish for up to `timeout` s; end the rest
        with EngineStoppedError (a stream sends it as an error event, then [DONE]) and
        give their readers up to a second to pick it up. The engine thread ends them;
        if it has not within a second (it is stuck), they are ended from here, so no
        reader waits on a wedged engine. -> requests ended early."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._num_open and time.monotonic() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        left = self._num_open
        if left and not self.errored:
            log.warning("shutdown: ending %d unfinished request(s)", left)
            err = EngineStoppedError(f"the server is shutting down; the request did not "
                                     f"finish within the {timeout:g} s drain time")
            with contextlib.suppress(EngineDeadError, EngineStoppedError):
                self._submit(FailAll(err))
            await self._wait_closed(1.0)
            if self._num_open:
                quiet, activity = self.stalled_for()
                log.error("shutdown: the engine thread did not end %d request(s) (its "
                          "loop last turned %.1f s ago, busy in %s); ending them here",
                          self._num_open, quiet, activity)
                for st in list(self._open.values()):
                    deliver(st, err)    # the mailbox is thread-safe; its error sticks
                if self._join_deadline is None:     # it ignored FailAll: nor will it Stop
                    self._join_deadline = time.monotonic() + WEDGED_JOIN_SECONDS
                await self._wait_closed(1.0)
        return left

    async def _wait_closed(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._num_open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def shutdown(self, timeout: float) -> None:
        """drain(timeout), then stop the engine thread. Later calls fail fast."""
        await self.drain(timeout)
        self._engine.stop()
        await asyncio.get_running_loop().run_in_executor(None, self._join)

    @property
    def drained_cleanly(self) -> bool:
        """The engine thread has ended (stopped, or died and was reported as such)."""
        return not self._engine.thread.is_alive()

    def _join(self) -> None:
        """Wait for the engine thread, out of one STOP_JOIN_SECONDS budget shared by
        every caller: a wedged thread costs that once, not once per caller."""
        if self._join_deadline is None:
            self._join_deadline = time.monotonic() + STOP_JOIN_SECONDS
        self._engine.join(max(0.0, self._join_deadline - time.monotonic()))

    def close(self) -> None:
        """At process exit, after shutdown(): stop the engine thread if it still runs,
        then release the engine itself (EngineClient.shutdown: DataParallelEngine's
        replica threads). Skipped, with an error, while the thread is still busy (it
        would block on it; see drained_cleanly); idempotent."""
        self._engine.stop()
        self._join()
        if self._engine.thread.is_alive():
            quiet, activity = self.stalled_for()
            log.error("the engine thread did not stop (its loop last turned %.1f s ago, "
                      "busy in %s); not releasing the engine", quiet, activity)
            return
        if not self._released:
            self._released = True
            self.core.shutdown()

    def _checked(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Defaults filled, then the final values checked (frontend/input_processor.py)."""
        return self.inputs.process(prompt_ids, params)[1]

    def _submit(self, cmd: Any) -> None:
        if not self.accepting and isinstance(cmd, AddRequest):
            self._engine.check_open()       # dead / stopped take precedence
            raise EngineStoppedError("the server is shutting down")
        self._engine.submit(cmd)

    def _stream_closed(self, st: _Stream) -> None:
        self._open.pop(id(st), None)
        self._num_open -= 1
        self._num_open_seqs -= st.num_seqs
