"""GrammarGate: the scheduler's side of structured outputs (host path).

    add_request   a constrained request starts compiling (backend.py) and waits in
                  WAITING_FOR_FSM, off the waiting queue, so requests behind it go on
    schedule()    compiled ones join the waiting queue (failed ones finish with the
                  reason, status ERROR); after scheduling, the rows that sample this
                  step get their token bitmask row from their matcher (SchedulerOutput.
                  grammar_bitmask: req_id -> W int32 words as bytes, so it crosses
                  hosts like the rest of the output)
    update        each kept token advances the matcher; a terminated grammar finishes
                  the request (stop); a rejected token fails it
    preemption    the matcher is rolled back to the tokens the request keeps
    reasoning     a request whose constraint starts after its reasoning
                  (reasoning_end.py) gets no mask row and moves no matcher until its
                  output holds the end sequence; its matcher starts after it

A mask needs the request's latest token on the host: the engine collects a step before
scheduling the next while any constrained request is active (core/engine_core.py), so a
constrained row never has a pending token when its mask is filled.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from typing import Any, Mapping

from jaxserve.request import FinishReason, Request, RequestStatus
from jaxserve.structured.backend import GrammarBackend
from jaxserve.structured.matcher import RequestGrammar, fill_bitmasks
from jaxserve.structured.reasoning_end import ReasoningWatch


@dataclass(slots=True)
class GrammarGate:
    backend: GrammarBackend
    compiling: dict[str, Request] = field(default_factory=dict)     # WAITING_FOR_FSM
    grammars: dict[str, RequestGrammar] = field(default_factory=dict)
    mask_seconds: float = 0.0            # host time filling bitmasks (all steps)
    mask_rows: int = 0                   # rows filled (all steps)
    # the on-device automaton (structured/device_compiler.DeviceStructured): a regular
    # constraint compiles for it too, and runs on the device if its tables are ready
    device: Any = None

    def hold(self, request: Request) -> bool:
        """Start compiling a constrained request's grammar; True if it must wait for it
        (False: unconstrained). Raises SamplingParamsError for a bad constraint."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        self.grammars[request.request_id] = RequestGrammar(self.backend.submit(params),
                                                           watch=ReasoningWatch.of(params))
        self.compiling[request.request_id] = request
        request.status = RequestStatus.WAITING_FOR_FSM
        if self.device is not None:
            self.device.start(request)
        return True

    def release(self, now: float) -> tuple[list[Request], list[Request]]:
        """(compiled: ready to queue, failed: request.error says why)."""
        ready: list[Request] = []
        failed: list[Request] = []
        for rid, request in list(self.compiling.items()):
            g = self.grammars[rid]
            if not g.ready(self.backend, now):
                continue
            on_device = (self.device.decide(request, now)
                         if self.device is not None and g.error is None else False)
            if on_device is None:
                continue                    # its device tables are still compiling
            del self.compiling[rid]
            if on_device:                   # no host matcher: the step runs its automaton
                del self.grammars[rid]
            if g.error is not None:
                request.error = g.error
                failed.append(request)
            else:
                request.status = RequestStatus.WAITING
                ready.append(request)
        return ready, failed

    def wait_compiling(self, timeout: float) -> None:
        """Idle engine with only compiles to wait for: block until one ends (or timeout)
        instead of spinning."""
        futures = [self.grammars[rid].job.future for rid in self.compiling]
        if self.device is not None:
            futures += self.device.futures()
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def active(self) -> bool:
        """Some compiled constrained request is queued or running (its masks need its
        latest token on the host)."""
        return len(self.grammars) > len(self.compiling)

    def bitmasks(self, sampling_req_ids: set[str], pending: Mapping[str, int]
                 ) -> dict[str, bytes]:
        """Mask rows of the constrained rows that sample this step (a row still in its
        reasoning has none: it samples freely)."""
        rids = [r for r in sampling_req_ids
                if r in self.grammars and not self.grammars[r].watch.reasoning]
        if not rids:
            return {}
        t0 = time.perf_counter()
        for r in rids:      # the step's own sampled token is its only pending one
            assert pending.get(r, 0) == 1, f"request {r!r}: mask without its latest token"
        words = fill_bitmasks(self.backend, [self.grammars[r] for r in rids])
        rows = {r: words[i].tobytes() for i, r in enumerate(rids)}
        self.mask_seconds += time.perf_counter() - t0
        self.mask_rows += len(rids)
        return rows

    def advance(self, request: Request, token: int) -> tuple[FinishReason, Any] | None:
        """Advance on a kept token. (STOP, None) when the grammar is complete, (ERROR,
        None) with request.error set when it rejects the token, else None."""
        g = self.grammars.get(request.request_id)
        if g is None:
            return None
        if g.watch.reasoning:           # a free token; the answer may start after it
            g.watch.observe(request.output_token_ids)
            return None
        if token in request.eos_token_ids and g.matcher is not None \
                and g.matcher.is_accepting():
            return FinishReason.STOP, None     # EOS where the grammar may end
        if not g.accept(token):
            request.error = g.rejection()
            return FinishReason.ERROR, None
        return (FinishReason.STOP, None) if g.terminated() else None

    def rollback(self, request: Request) -> None:
        """The request keeps only its output tokens so far (preemption): match them."""
        g = self.grammars.get(request.request_id)
        if g is not None and g.matcher is not None:
            g.rollback_to(g.watch.kept(len(request.output_token_ids)))

    def forget(self, req_id: str) -> None:
        self.grammars.pop(req_id, None)
        self.compiling.pop(req_id, None)
        if self.device is not None:
            self.device.forget(req_id)
