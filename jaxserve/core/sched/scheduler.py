"""Scheduler: vLLM v1's unified token-budget policy (no prefill phase, no decode phase).

Each step has a budget of `max_num_batched_tokens`. Every request has
`num_computed_tokens` catching up with its tokens:

    running (oldest first)    each takes min(tokens left, budget, long-prefill cap);
                              if its blocks cannot be allocated, the NEWEST running
                              request is preempted (recompute) until they can
    waiting (arrival order)   prefix hits first, then a chunk of what is left;
                              stops at the first that does not fit (FCFS), at
                              max_num_seqs, or if anything was preempted this step

A preempted request loses its KV and its runner state; it goes back to the front of
the waiting queue and later re-prefills prompt + outputs so far (often from cache).

Pending tokens (asynchronous scheduling): schedule() advances num_computed_tokens at
once and counts each token a scheduled row will sample as pending, so the next step
can be scheduled before this one's tokens reach the host: a row whose only new token
is pending reads it on the device (the runner's feed). update_from_output later
appends the real token (stop checks run then). A request whose pending tokens already
reach its length limit is not scheduled again; one that turns out to have stopped
(EOS, stop token) got one extra step, whose token the update drops. Prefix-cache
hashes cover only known tokens (the KV manager caps them at num_tokens).

Speculative decoding (spec_decode/): in a step scheduled with speculate=True, a
decoding request with no pending token gets up to k proposed tokens from the proposer;
they count in the token budget and run as extra tokens of its row, and the row emits
1..k+1 tokens. update_from_output rolls num_computed_tokens back over the rejected
ones (their KV slots are overwritten later; the blocks stay with the request, which
needs them again next step). Proposals are never in num_tokens, so prefix-cache hashes
cover accepted tokens only. Proposals never let a request pass its length limit.
Speculating needs the request's latest token on the host: the engine collects the
previous step before scheduling a speculating one (core/engine_core.py).

Multi-step decode (decode_steps = K > 1): when every running request is decoding (one
token to compute), nothing waits, no row speculates or follows a host grammar, and the
KV pool has the blocks, a step runs k <= K decode steps back to back on the device
(SchedulerOutput.num_steps): each row computes k_r <= k tokens (its num_scheduled_tokens)
and samples k_r, each fed from the one before, and the host learns them together. k_r
is k capped by the row's length limit, so no row is scheduled past it (a row that
reaches it sits out the step's later decode steps); a row that stops early (EOS, a stop
token or string) has its later tokens dropped by update_from_output, as with speculation. It
cuts the host's work per token by ~k at small batches, where that work is on the
critical path (docs/benchmarks.md, "Multi-step decode"), at the cost of tokens reaching
the host k at a time; a request arriving meanwhile waits for the step. So by default
it runs only while no running request streams (output_kind FINAL_ONLY: offline
generate, non-streaming HTTP), and a stream gets each token as soon as it is sampled;
multi_step_streams lifts that.

Lifecycle:  WAITING --schedule--> RUNNING --update/finish--> FINISHED
                ^                    |
                +----- PREEMPTED <---+  (front of the waiting queue)
A constrained request (structured outputs) first waits in WAITING_FOR_FSM, off the
queue, while its grammar compiles (structured/scheduling.py), then joins the queue.

External KV (sched/loading.py): a new request's prefix KV may come from another engine
(KV transfer) or an offload tier; it then gets fresh blocks and either runs at once
(host tier) or waits off the queue until its load ends.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.core.sched.loading import KVLoads
from jaxserve.request import FinishReason, Request, RequestStatus
from jaxserve.core.sched.output import (CachedRequestData, NewRequestData, SchedulerOutput,
                                        StepKind)
from jaxserve.core.sched.token_stops import check_stop, max_output_tokens
from jaxserve.sampling.params import RequestOutputKind
from jaxserve.core.sched.waiting import WaitingQueue
from jaxserve.spec_decode.stats import SpecDecodingStats


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, block_size: int,
                 long_prefill_token_threshold: int = 0,
                 enable_chunked_prefill: bool = True,
                 fit_chunk: Callable[[int, int], int] | None = None,
                 proposer: Any = None, decode_steps: int = 1,
                 decode_steps_max_rows: int = 0, multi_step_streams: bool = False,
                 grammar: Any = None, connector: Any = None,
                 max_loading_blocks: int | None = None, offload: Any = None,
                 max_loras: int = 0) -> None:
        """decode_steps: most decode steps one step may run back to back (multi-step
        decode, see the module doc; 1: off); decode_steps_max_rows: only for batches of
        at most this many requests (0: any); multi_step_streams: also while a running
        request streams. grammar: the structured-output gate (structured/scheduling.py)
        or None; connector: the KV transfer connector (kv_transfer/connector.py) or
        None, with max_loading_blocks the most fresh blocks its pulls (and disk reads)
        may hold; offload: the KV offload tiers (kv_transfer/offload.py) or None.
        max_loras: the most distinct LoRA adapters among running requests (the device
        slots); a waiting request of another adapter waits at the head of the queue
        (first come, first served: it starts once a running adapter's requests finish)."""
        if block_size != kv_cache_manager.block_size:
            raise ValueError(f"block_size {block_size} != KV cache manager's "
                             f"{kv_cache_manager.block_size}")
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len "
                             "must be positive")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len})")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        # (tokens already in the step, wanted) -> chunk: ends a step on a padding bucket
        self.fit_chunk = fit_chunk if enable_chunked_prefill else None
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.decode_steps = decode_steps
        self.decode_steps_max_rows = decode_steps_max_rows or max_num_seqs
        self.multi_step_streams = multi_step_streams
        self.requests: dict[str, Request] = {}      # unfinished only
        self.waiting = WaitingQueue()               # O(1) abort (see waiting.py)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()        # since the last schedule()
        self._pending: dict[str, int] = {}          # req_id -> sampled, not yet appended
        # speculative decoding: proposer.propose(req_id, prompt, output, max_k) -> ids
        self.proposer = proposer
        self.spec_stats = SpecDecodingStats(proposer.k if proposer is not None else 0)
        self._draft_room = 0                        # proposals still allowed this step
        self._row_steps: dict[str, int] = {}        # multi-step decode: req_id -> k_r
        # requests whose prompt KV comes from another engine or an offload tier
        self.loads = KVLoads(kv_cache_manager, connector=connector, offload=offload,
                             max_blocks=max_loading_blocks)
        self.connector: Any = connector
        self.offload: Any = offload
        # structured outputs (structured/scheduling.py): a request
        # whose grammar compiles waits there, off the queue; `failed` holds requests
        # finished outside any step (their grammar failed) until the engine reports them
        self.grammar: Any = grammar
        self.failed: list[Request] = []
        self.max_loras = max_loras

    # ------------------------------------------------------------------ intake
    def add_request(self, request: Request, host_grammar: bool = True) -> None:
        """Queue a request; ValueError if it could never run (nothing is queued).
        host_grammar=False: its constraint runs on the device (no host matcher)."""
        self._validate(request)
        request.status = RequestStatus.WAITING
        held = host_grammar and self._hold_for_grammar(request)
        self.requests[request.request_id] = request
        if not held:
            self.waiting.append(request)

    def _hold_for_grammar(self, request: Request) -> bool:
        """A constrained request starts compiling its grammar and waits for it."""
        if request.sampling_params.structured_outputs is None:
            return False
        if self.grammar is None:
            raise ValueError("structured outputs need the model's tokenizer, which this "
                             "engine was built without (or a multi-host run)")
        return self.grammar.hold(request)

    def _release_grammars(self) -> None:
        """Compiled requests join the queue; failed ones finish (status ERROR)."""
        now = time.monotonic()
        ready, failed = self.grammar.release(now)
        for request in ready:
            self.waiting.append(request)
        for request in failed:
            request.finish_reason = FinishReason.ERROR
            self._finish(request, now)
            self.failed.append(request)

    def _validate(self, request: Request) -> None:
        rid, prompt_len = request.request_id, request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if rid in self.requests:
            raise ValueError(f"request {rid!r}: duplicate request id")
        if prompt_len == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {max_tokens}")
        # a pooling request's one sampled token is never stored: the prompt alone counts
        out_len = 0 if request.sampling_params.pooled else (
            max_tokens if max_tokens is not None else 1)
        wanted = prompt_len + out_len
        if wanted > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {prompt_len} tokens + max_tokens="
                f"{out_len} = {wanted} tokens exceeds "
                f"max_model_len={self.max_model_len}")
        # The last sampled token is never fed back, so its KV is never stored.
        blocks = self.kv.num_blocks_for(prompt_len + max(0, max_output_tokens(
            request, self.max_model_len) - 1))
        if blocks > self.kv.num_blocks:
            raise ValueError(
                f"request {rid!r}: needs {blocks} KV blocks (prompt {prompt_len} tokens, "
                f"block_size {self.block_size}) but the cache has only {self.kv.num_blocks}")

    # ---------------------------------------------------------------- schedule
    def schedule(self, speculate: bool = False) -> SchedulerOutput:
        """speculate: propose tokens for decoding requests this step (the caller has
        collected every earlier step, so no request has a pending token)."""
        out = SchedulerOutput([], [], {}, 0, finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        if self.grammar is not None and self.grammar.compiling:
            self._release_grammars()
        # A step samples at most max_num_seqs logit rows (one per row, one more per
        # proposal): rows the step may admit keep theirs.
        self._draft_room = 0 if not (speculate and self.proposer is not None) else max(
            0, self.max_num_seqs - len(self.running) - len(self.waiting))
        self._row_steps = {} if speculate else self._plan_multi_step()
        out.num_steps = max(self._row_steps.values(), default=1)
        if out.num_steps > 1:
            out.kind = StepKind.MULTI_STEP_DECODE
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        if out.scheduled_spec_decode_tokens:
            out.kind = StepKind.VERIFY
        if self.grammar is not None:
            out.grammar_bitmask = self.grammar.bitmasks(out.sampling_req_ids, self._pending)
        return out

    def _plan_multi_step(self) -> dict[str, int]:
        """Multi-step decode: request id -> the decode steps (k_r > 0) its row runs this
        step, or {} for an ordinary step (see the module doc for when). Requests whose
        pending tokens reach their length limit are not in it (not scheduled)."""
        # every row's k tokens count in the step's token budget
        K = min(self.decode_steps, self.max_num_batched_tokens // max(1, len(self.running)))
        if (K <= 1 or not self.running or self.waiting or self.failed
                or len(self.running) > self.decode_steps_max_rows
                or (self.grammar is not None and (self.grammar.compiling
                                                  or self.grammar.active()))):
            return {}
        steps: dict[str, int] = {}
        fresh = 0
        for request in self.running:
            rid = request.request_id
            pending = self._pending.get(rid, 0)
            if request.num_tokens + pending - request.num_computed_tokens != 1:
                return {}               # a prefill chunk to compute
            if (not self.multi_step_streams and request.sampling_params.output_kind
                    is not RequestOutputKind.FINAL_ONLY):
                return {}               # its stream gets each token when sampled
            left = (max_output_tokens(request, self.max_model_len)
                    - len(request.output_token_ids) - pending)
            if left <= 0:
                continue                # ends when its pending tokens are known
            steps[rid] = k = min(K, left)
            fresh += max(0, self.kv.num_blocks_for(request.num_computed_tokens + k)
                         - len(self.kv.get_block_ids(rid)))
        # the blocks for every row's tokens must be there without a preemption
        if max(steps.values(), default=1) <= 1 or fresh > self.kv.num_free_blocks:
            return {}
        return steps

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        # Speculative decoding will add draft tokens here (num_tokens_with_spec).
        n = request.num_tokens + self._pending.get(request.request_id, 0) - num_computed
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        return min(n, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if n <= 0 or self._ends_when_known(request):
                i += 1
                continue
            if out.kind is StepKind.MULTI_STEP_DECODE:     # its one token, k_r times
                n = self._row_steps[request.request_id]
            drafts = self._propose(request, n, budget)
            n += len(drafts)
            new_block_ids = self.kv.allocate_slots(request, n)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.add(victim.request_id)
                if victim is request:
                    return budget
                new_block_ids = self.kv.allocate_slots(request, n)
            out.scheduled_cached_reqs.append(CachedRequestData(
                request.request_id, new_block_ids, request.num_computed_tokens))
            if drafts:
                out.scheduled_spec_decode_tokens[request.request_id] = drafts
                self._draft_room -= len(drafts)
            self._advance(out, request, n)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if self.connector is not None and not request.num_computed_tokens:
                started = self.loads.start_remote(request, *self._computed_blocks(request))
                if started is None:
                    break                   # no room for its blocks yet (FCFS)
                if started:
                    self.waiting.popleft()  # waits off the queue for its KV
                    continue
            if request.lora is not None and not self._lora_fits(request):
                break                   # every adapter slot is taken (FCFS: no starvation)
            # a request back from a remote load has its blocks and computed tokens
            hits, num_hit_tokens = (([], request.num_computed_tokens)
                                    if request.num_computed_tokens
                                    else self._computed_blocks(request))
            if (self.offload is not None and not request.num_computed_tokens
                    and self._prefix_cacheable(request)):
                loaded = self.loads.start_offload(request, hits)
                if loaded is None:
                    break                   # no room for its blocks yet (FCFS)
                if loaded < 0:
                    self.waiting.popleft()  # waits off the queue for its files
                    continue
                if loaded:                  # in host memory: written before this step
                    hits, num_hit_tokens = [], request.num_computed_tokens
            wanted = request.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and wanted > budget:
                break
            n = wanted_n = self._num_new_tokens(request, num_hit_tokens, budget)
            if self.fit_chunk is not None and n > 1:
                n = self.fit_chunk(self.max_num_batched_tokens - budget, n)
            new_block_ids = self.kv.allocate_slots(request, n, hits)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            self._start_running(request, num_hit_tokens)
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=request.request_id, token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens,
                eos_token_ids=request.eos_token_ids, lora=request.lora))
            self._advance(out, request, n)
            budget -= n
            if n < wanted_n:        # cut to end on a bucket: adding more would pad again
                break
        return budget

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter is running already or a slot is free for it."""
        active = {r.lora.key for r in self.running if r.lora is not None}
        return request.lora.key in active or len(active) < self.max_loras

    @property
    def loading(self) -> dict[str, Request]:
        """Requests waiting off the queue for their KV (sched/loading.py)."""
        return self.loads.requests

    def finish_loading(self, req_id: str, num_computed: int | None) -> None:
        """A load ended (the engine has written its blocks): the request queues first
        with num_computed tokens computed; failed (None), it drops its blocks and
        computes its prompt itself. A request finished meanwhile is ignored."""
        request = self.loads.pop(req_id)
        if request is None:
            return
        if num_computed is None:
            self.kv.free(request)
        else:
            request.num_computed_tokens = num_computed
        self.waiting.appendleft(request)

    def _propose(self, request: Request, n: int, budget: int) -> list[int]:
        """Proposed tokens for a decoding request (n == 1: only its last token to
        compute, none pending), within the budget, the step's room and its length limit
        (k proposals can emit k + 1 tokens)."""
        if (self._draft_room <= 0 or n != 1 or request.request_id in self._pending
                or not getattr(request.sampling_params, "speculative", True)
                or getattr(request.sampling_params, "structured_outputs", None) is not None
                or (request.sampling_params.prompt_logprobs is not None
                    and not request.output_token_ids)):     # rows of prompt positions only
            return []
        left = max_output_tokens(request, self.max_model_len) - len(request.output_token_ids)
        max_k = min(self._draft_room, budget - 1, left - 1)
        if max_k <= 0:
            return []
        return self.proposer.propose(request.request_id, request.prompt_token_ids,
                                     request.output_token_ids, max_k)

    def _computed_blocks(self, request: Request) -> tuple[list, int]:
        """Prefix-cache hits, except for a request that wants prompt logprobs and has
        no output yet, or a pooling request (an embedding): it must compute every prompt
        position (vLLM does the same; a cached block holds KV, not the hidden states);
        its blocks are still cached for others once computed."""
        if not self._prefix_cacheable(request):
            return [], 0
        return self.kv.get_computed_blocks(request)

    def _prefix_cacheable(self, request: Request) -> bool:
        params = request.sampling_params
        return self.kv.enable_prefix_caching and not (
            params.pooled or (params.prompt_logprobs is not None
                              and not request.output_token_ids))

    def _advance(self, out: SchedulerOutput, request: Request, n: int) -> None:
        """Schedule n tokens of the request in `out` (call after its data is added:
        the runner gets num_computed_tokens before the step)."""
        rid = request.request_id
        out.num_scheduled_tokens[rid] = n
        pending = self._pending.get(rid, 0)
        if pending:
            out.num_pending[rid] = pending
        request.num_computed_tokens += n
        if request.num_computed_tokens >= request.num_tokens + pending:
            self._pending[rid] = pending + out.tokens_sampled(rid)
            out.sampling_req_ids.add(rid)

    def _ends_when_known(self, request: Request) -> bool:
        """Its pending tokens reach the length limit: nothing left to schedule."""
        pending = self._pending.get(request.request_id, 0)
        return pending > 0 and len(request.output_token_ids) + pending >= max_output_tokens(
            request, self.max_model_len)

    def _start_running(self, request: Request, num_hit_tokens: int) -> None:
        metrics = request.metrics
        assert metrics is not None
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = time.monotonic()
            metrics.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._pending.pop(request.request_id, None)   # a token still in flight is dropped
        if self.grammar is not None:
            self.grammar.rollback(request)
        assert request.metrics is not None
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        """Append the tokens a step sampled (its pending tokens), run stop checks.

        schedule() already advanced num_computed_tokens; the rows it marked as sampling
        take their token here, tokens given for rows still in prefill are ignored, and
        so are those of requests finished or preempted since (their extra token is
        dropped). Returns the requests that got a token or finished, in schedule order."""
        changed: list[Request] = []
        now = time.monotonic()
        if scheduler_output.scheduled_spec_decode_tokens:
            self.spec_stats.num_spec_steps += 1
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue    # finished or preempted since it was scheduled
            if req_id not in scheduler_output.sampling_req_ids:
                continue
            tokens = sampled_token_ids.get(req_id) or []
            assert tokens, f"request {req_id!r} reached its tokens but sampled nothing"
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:      # roll back over the rejected proposals
                accepted = len(tokens) - 1
                assert 0 <= accepted <= len(drafts), (req_id, tokens, drafts)
                request.num_computed_tokens -= len(drafts) - accepted
                self.spec_stats.observe(len(drafts), accepted)
            left = self._pending[req_id] - scheduler_output.tokens_sampled(req_id)
            if left > 0:
                self._pending[req_id] = left
            else:
                del self._pending[req_id]
            if self._append_tokens(request, tokens, now):
                if self.connector is not None:      # a prefill to save (before free)
                    self.connector.request_finished(request, self.kv.get_block_ids(req_id))
                self._finish(request, now)
            changed.append(request)
        if any(r.is_finished for r in changed):
            self.running = [r for r in self.running if not r.is_finished]
        return changed

    def _append_tokens(self, request: Request, tokens: list[int], now: float) -> bool:
        """Append tokens up to the first stop; True if the request is done. Tokens
        after the stop (several come at once with speculative decoding) are deleted
        from `tokens`, so the caller reports only what was appended."""
        assert request.metrics is not None
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            reason = check_stop(request, self.max_model_len)
            if reason is None and self.grammar is not None:
                reason = self.grammar.advance(request, token)
            if reason is not None:
                request.finish_reason, request.stop_reason = reason
                del tokens[i + 1:]
                return True
        return False

    def _finish(self, request: Request, now: float) -> None:
        """Mark finished and release everything; the caller updates the queues."""
        request.status = RequestStatus.FINISHED
        assert request.metrics is not None
        request.metrics.finished_time = now
        self.kv.free(request)
        self._pending.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        if self.grammar is not None:
            self.grammar.forget(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self.loads.pop(request.request_id)
        if self.connector is not None:
            self.connector.forget(request.request_id)
        self._finished_ids.add(request.request_id)

    def finish_requests(self, req_ids: str | Iterable[str],
                        finish_reason: FinishReason) -> None:
        """Finish requests from outside (abort, stop string). Unknown or already
        finished ids are ignored."""
        ids = {req_ids} if isinstance(req_ids, str) else set(req_ids)
        now = time.monotonic()
        any_running = False
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.finish_reason = finish_reason
            # A waiting request leaves its queue in O(1); only a running one costs a
            # pass over the (max_num_seqs-bounded) running list below.
            any_running |= self.waiting.remove(req_id) is None
            self._finish(request, now)
        if any_running:
            self.running = [r for r in self.running if not r.is_finished]

    # ------------------------------------------------------------------- state
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (len(self.grammar.compiling) if self.grammar else 0)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)
