"""JaxModelRunner: turns a SchedulerOutput into one padded, jitted step on the device.

It owns the device arrays (weights, KV cache, sampler state) and a persistent numpy
block table; it decides nothing (the scheduler and KV manager do). Per step:

    SchedulerOutput --update states--> flat ragged batch (numpy)
        --pad to bucket (T, P)--> step(weights, kv, tokens, md, sampling, ...) [jit, kv donated]
        --> sampled tokens for the rows whose prompt/decode reached its end

dispatch() returns once the step is launched; collect() waits for its tokens. With
asynchronous scheduling the engine dispatches step N+1 before collecting step N: a
row's token sampled at step N is then "pending" (counted by the scheduler, which owns
the count and sends it with each step, not yet on the host) and step N+1 reads it on
the device from the slot's last sampled token (StepState).

Multi-step decode (decode_steps > 1, the fused step only): a step the scheduler gave
num_steps = k > 1 runs k decode steps in one program; every step's packed inputs then
carry k ("steps"), the outputs come back stacked [decode_steps, rows], and each row's
k tokens are appended at once (the scheduler drops those past a stop).
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.threads import beside
from jaxserve.worker import executables
from jaxserve.worker.buckets import BucketSet
from jaxserve.sampling import prompt_logprobs as prompt_lp
from jaxserve.worker import pooling as pool_rows
from jaxserve.worker.packing import pack
from jaxserve.worker.layerwise_step import HybridStep, LayerwiseStep
from jaxserve.worker.step_programs import FusedStep, StepState, head_weights
from jaxserve.worker.drafter.protocol import Drafter, Proposals
from jaxserve.worker.lora_slots import LoRASlots
from jaxserve.worker.step_config import StepConfig
from jaxserve.worker.step_records import CachedRequestState, InflightStep, StepResult
from jaxserve.worker.step_inputs import StepBatch, build_step_batch
from jaxserve.model.cpu import matmul as cpu_matmul, greedy_head
from jaxserve.model import decoder
from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import rope_inv_freq
from jaxserve.model.pooling import PoolingConfig
from jaxserve.model.quant import weight_bytes
from jaxserve.sampling import in_step as sampler_mod
from jaxserve.core.sched.output import SchedulerOutput, StepKind
from jaxserve.structured.device_pool import DeviceAutomata

log = logging.getLogger("jaxserve")
# Step shapes compiled side by side at warm-up (XLA:CPU compiles a program on one core).
WARMUP_THREADS = int(os.environ.get("JAXSERVE_WARMUP_THREADS", "2"))
# branch-free sampler (GPU): "one" program per sampler row count (in_step.GENERAL_PLAN),
# or "all": every plan of in_step.all_plans, the lightest picked per step (6x the
# sampler programs at warm-up, a little less sampler work per step)
SAMPLER_PLANS = os.environ.get("JAXSERVE_SAMPLER_PLANS", "one")


class JaxModelRunner:
    """The model runner (worker/protocol.ModelRunner) for JAX programs on one mesh."""

    def __init__(self, cfg: ModelConfig, weights: Any, *, num_blocks: int, block_size: int,
                 buckets: BucketSet, max_model_len: int, attn_backend: Any, dtype: Any,
                 seed: int, max_logprobs: int, eos_token_ids: tuple[int, ...] = (),
                 step: StepConfig, plan: Any = None,
                 num_speculative_tokens: int = 0, token_mask_words: int = 0,
                 kv_cache_dtype: str = "auto",
                 drafter: Callable[["JaxModelRunner"], Drafter] | None = None,
                 pooling: PoolingConfig | None = None,
                 lora: tuple[int, int] | None = None) -> None:
        """step: every choice about how steps run (worker/step_config.py), made by the
        engine; the runner follows it and decides none of them itself. drafter: builds
        the device drafter from the finished runner (it reads the runner's weights, KV
        and tables), or None. pooling: the model serves embeddings pooled this way
        (model/pooling.py), or None. lora: (max_loras, max_lora_rank): every layer gets
        LoRA slot arrays and every step each token's slot (worker/lora_slots.py)."""
        if plan is not None:    # [sharding] with the plan's KV layout (kv_head_replicas)
            cfg = plan.runtime_cfg
        self.cfg = cfg
        self.step_config = step
        # [sharding] plan: parallel.ShardingPlan or None (one device). Weights and KV are
        # placed with its shardings; jit propagates them, the step code is unchanged.
        self.plan = plan
        # kv_cache_dtype int8 / fp8: each layer's k and v are attention/kv_quant.QuantizedKV;
        # the backend's layout (attention/kv_layout.py): (k, v) or page-major (kv, None)
        self.kv_layout = attn_backend.kv_layout
        # One device: the zeroed KV cache is made on a thread beside the weights' packing:
        # filling it (1 GiB by default on CPU, the first touch of every page) runs in XLA
        # with the GIL released, time a warm start otherwise spends in turn. A plan keeps
        # the order of its programs (every host of a multi-host run issues the same ones).
        kv_job = None if plan is not None else beside(_under_callers_device(
            lambda: decoder.init_kv_cache(cfg, num_blocks, block_size, dtype,
                                          kv_cache_dtype, self.kv_layout)),
            name="runner-init")
        self.weights = plan.shard_weights(weights) if plan is not None else weights
        if cfg.cpu_matmul:      # the C++ kernel's layout for the layer projections
            self.weights = cpu_matmul.pack_weights(self.weights)
            log.info("weights as the CPU kernels read them: %.1f MiB resident",
                     weight_bytes(self.weights) / 2**20)
            # greedy rows' tokens from a float16 copy of the packed head (greedy_head.py)
            self.weights = greedy_head.add_screen(self.weights, step.greedy_head)
        self.lora_slots: LoRASlots | None = None
        if lora is not None:
            # the slot arrays join this runner's own copy of the layer dicts
            self.weights = {**self.weights, "layers": [dict(l) for l in self.weights["layers"]]}
            self.lora_slots = LoRASlots(cfg, self.weights, max_loras=lora[0], max_rank=lora[1],
                                        dtype=dtype, on_trace=self.count_compile,
                                        plan=plan)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.buckets = buckets
        self.backend = attn_backend
        self.max_logprobs = max_logprobs
        self.spec_width = num_speculative_tokens   # > 0: the step verifies proposals
        # > 0: structured outputs served; every step carries a [R, W] token bitmask
        # (all ones but the constrained rows: sampling/bitmask.py)
        self.mask_words = token_mask_words
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.kv = (kv_job.result() if kv_job is not None
                   else plan.init_kv_cache(num_blocks, block_size, dtype,  # [sharding]
                                           kv_cache_dtype, self.kv_layout))
        num_slots = buckets.max_num_seqs
        self.block_table = np.zeros((num_slots + 1, self.max_blocks_per_seq), np.int32)
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pad_slot = num_slots          # padding rows point at an always-empty slot
        self.states: dict[str, CachedRequestState] = {}
        # Structured outputs on the device (structured/device_pool.py): the automaton
        # tables of live constraints and each slot's state ride in the step state.
        self.automata = DeviceAutomata(num_slots + 1, cfg.vocab_size)
        self.sampler_state = StepState(sampler_mod.init_state(num_slots + 1, cfg.vocab_size),
                                       jnp.zeros(num_slots + 1, jnp.int32),
                                       self.automata.init_pool())
        if plan is not None:   # [sharding] committed like the step's outputs: no recompiles
            self.sampler_state = plan.replicate(self.sampler_state)
        self.base_key = jax.random.PRNGKey(seed)   # on the device; steps fold in their count
        self.step_count = 0
        self.num_compiles = 0
        # programs compiled on first use by design (prompt logprobs), apart from the
        # step programs' count, which stays flat after warm-up
        self.num_lazy_compiles = 0
        self.inv_freq = jnp.asarray(rope_inv_freq(cfg))
        self.branch = step.sampler_branches
        self.plans = sampler_mod.warmup_plans(self.branch, every=SAMPLER_PLANS == "all")
        # One transfer per step: the packed inputs, placed where the step reads them.
        self._input_sharding = (plan.replicated() if plan is not None and
                                jax.process_count() == 1 else None)
        self.decode_steps = step.decode_steps
        # the buckets up to this one carry the multi-step loop (one layout per bucket)
        self._multi_bucket = step.multi_step_bucket
        # compiled step programs kept across starts (worker/executables.py), keyed by
        # everything the programs close over; None: off (and for sharded programs)
        self.executables = None if plan is not None else executables.store_for({
            "model": repr(cfg), "step": repr(step),
            "backend": [getattr(attn_backend, "name", None),
                        getattr(attn_backend, "needs_full_block_tables", None)],
            "block_size": block_size, "num_blocks": num_blocks, "max_logprobs": max_logprobs,
            "spec_width": num_speculative_tokens, "mask_words": token_mask_words,
            "kv_cache_dtype": kv_cache_dtype, "lora": lora, "pooling": repr(pooling),
            "drafter": drafter is not None, "dtype": str(jnp.dtype(dtype)),
            "mesh": str(getattr(plan, "mesh", None)), "plans": repr(self.plans)})
        self._step = self._make_step(kv_cache_dtype)
        self.in_turn_above = step.block_dispatch_above
        # Prompt logprobs: one more program over the step's hidden states, run only by
        # steps that have a row wanting them (sampling/prompt_logprobs.py); compiled on
        # first use per token bucket, not at warm-up (few requests ask for them).
        self._hidden_sharding = plan.replicated() if plan is not None else None
        self._prompt_lp = prompt_lp.PromptLogprobProgram(
            cfg, max_logprobs, self.count_lazy_compile,
            jit_kwargs={"out_shardings": self._hidden_sharding} if plan is not None else None)
        # Embeddings: the pooling program over the same hidden states, run only by steps
        # with a pooling row (worker/pooling.py), compiled only for an embedding model.
        self.pooler = pool_rows.StepPooler(
            cfg, pooling.pooling_type, buckets.max_num_seqs, self.count_compile,
            hidden_sharding=self._hidden_sharding, input_sharding=self._input_sharding
        ) if pooling is not None else None
        # proposes a verifying step's tokens (worker/drafter/protocol.py)
        self.drafter: Drafter | None = drafter(self) if drafter is not None else None
        if self.drafter is not None:
            self.sampler_state = replace(self.sampler_state,
                                         draft_probs=self.drafter.initial_draft_probs())

    def _make_step(self, kv_cache_dtype: str) -> Any:
        """The step in the configured form (worker/step_programs.py)."""
        plan, cfg, step = self.plan, self.cfg, self.step_config
        fused = layerwise = None
        if step.form != "layerwise":
            fused = FusedStep(cfg, self.inv_freq, self.backend.attn_fn, self.max_logprobs,
                              self.count_compile,
                              plan.step_jit_kwargs(kv_cache_dtype, self.kv_layout)
                              if plan is not None else None,
                              branch=self.branch, decode_steps=self.decode_steps,
                              block_size=self.block_size,
                              num_kv_slots=self.num_blocks * self.block_size,
                              store=self.executables)
        if step.form != "fused":
            layerwise = LayerwiseStep(cfg, self.inv_freq, self.backend.attn_fn,
                                      self.max_logprobs, self.count_compile,
                                      plan.layerwise_jit_kwargs(kv_cache_dtype, self.kv_layout)
                                      if plan is not None else None,
                                      layers_per_call=step.layers_for,
                                      store=self.executables)
        if step.form == "hybrid":
            assert fused is not None and layerwise is not None
            return HybridStep(fused, layerwise, step.small_step_tokens)
        return fused if fused is not None else layerwise

    def multi_step_rows(self) -> int:
        """The largest decode batch (requests) a multi-step step may have (0: off)."""
        return self.step_config.multi_step_rows

    def count_compile(self) -> None:
        """Called by every program this runner owns (the drafter's too) while it traces:
        counts compilations, which must stay flat after warm-up."""
        self.num_compiles += 1

    def count_lazy_compile(self) -> None:
        """Called while a program compiled on first use traces (num_lazy_compiles)."""
        self.num_lazy_compiles += 1

    # ---- request states (the diff from the scheduler) ------------------------------------
    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diff (finished, preempted, new and resumed requests,
        appended blocks) to the runner's request states; dispatch does it first, an
        empty step calls it alone."""
        for rid in so.finished_req_ids:
            self.automata.detach(rid)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            st = self.states.pop(rid, None)
            if st is not None:
                self.free_slots.append(st.slot)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.states:                     # resumed without a preempt diff
                self.free_slots.append(self.states.pop(new.req_id).slot)
            slot = self.free_slots.pop()
            st = CachedRequestState(new.req_id, list(new.token_ids), new.num_prompt_tokens,
                                    new.sampling_params, getattr(new, "eos_token_ids", ()),
                                    list(new.block_ids), new.num_computed_tokens, slot,
                                    lora=getattr(new, "lora", None))
            # Entries for every prompt position need the prompt computed from its start
            # (the scheduler gives such a request no prefix hits) and no output yet
            # (a request resumed after preemption already handed them over).
            if (new.sampling_params.prompt_logprobs is not None
                    and new.num_computed_tokens == 0
                    and len(new.token_ids) == new.num_prompt_tokens):
                st.prompt_logprobs = []
            if new.sampling_params.pooled:
                # every prompt position from 0: the scheduler gives it no prefix hits
                assert new.num_computed_tokens == 0 and self.pooler is not None, new.req_id
                st.pool = pool_rows.PoolAccumulator()
            self.states[new.req_id] = st
            self.block_table[slot] = 0
            self.block_table[slot, :len(st.block_ids)] = st.block_ids
            self._set_prompt(slot, st.token_ids, st.num_prompt_tokens)
            self._start_automaton(st)
        for cached in so.scheduled_cached_reqs:
            st = self.states[cached.req_id]
            if cached.new_block_ids:
                n = len(st.block_ids)
                st.block_ids.extend(cached.new_block_ids)
                self.block_table[st.slot, n:len(st.block_ids)] = cached.new_block_ids
            st.num_computed_tokens = cached.num_computed_tokens
            st.num_pending = so.num_pending.get(cached.req_id, 0)

    def _set_prompt(self, slot: int, token_ids: list[int], num_prompt: int) -> None:
        pen = sampler_mod.set_prompt(self.sampler_state.penalties, slot, token_ids, num_prompt,
                                     self.max_blocks_per_seq * self.block_size)
        self.sampler_state = replace(self.sampler_state, penalties=pen)

    def _start_automaton(self, st: CachedRequestState) -> None:
        """The slot's device automaton state: the request's initial state, or after a
        preemption the one its kept outputs lead to (none: unconstrained)."""
        pool = self.automata.start_slot(self.sampler_state.automaton, st.slot, st.req_id,
                                        st.token_ids[st.num_prompt_tokens:])
        self.sampler_state = replace(self.sampler_state, automaton=pool)

    # ---- one step: dispatch (async) then collect ----------------------------------------
    def execute(self, so: SchedulerOutput) -> StepResult:
        return self.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput) -> InflightStep:
        """Build the batch and launch the step; returns without waiting for the device."""
        t0 = time.perf_counter()
        self.update_states(so)
        if self.lora_slots is not None:     # before proposing: a `self` draft reads them
            self._place_adapters(so)
        if self.drafter is not None and so.kind is StepKind.VERIFY:
            self.apply_proposals(so, self.drafter.propose(so))     # one round trip
        batch = build_step_batch(so, self.states, self.block_table, self.buckets,
                                 block_size=self.block_size, num_blocks=self.num_blocks,
                                 pad_slot=self.pad_slot,
                                 full_tables=self.backend.needs_full_block_tables,
                                 lora=self.lora_slots is not None)
        sampling = self._sampling_inputs(batch, self.states, self.step_count,
                                         so.grammar_bitmask)
        step_plan = self.plans[0] if len(self.plans) == 1 else sampler_mod.plan_for(sampling)
        targets = prompt_lp.build_targets(batch, self.states)
        packed = self._pack(batch, sampling, so)
        self.step_count += so.num_steps
        row_states = [self.states[rid] for rid in batch.row_req_ids]
        for st in row_states:
            st.num_computed_tokens += so.num_scheduled_tokens[st.req_id]
        t1 = time.perf_counter()
        dev = packed.to_device(self._input_sharding)
        if self.drafter is not None:        # a draft model's KV follows the target's
            self.drafter.mirror(dev, self.sampler_state)
        out, self.kv, self.sampler_state = self._step(
            self.weights, self.kv, dev, self.sampler_state, self.base_key, step_plan)
        prompt = None
        if targets is not None:
            prompt = (self._prompt_lp(head_weights(self.weights), self._step.last_hidden,
                                      jax.device_put(targets[0], self._input_sharding)),
                      targets[1])
        pooled = (self.pooler.launch(batch, self.states, head_weights(self.weights),
                                     self._step.last_hidden)
                  if self.pooler is not None else None)
        if self.in_turn_above is not None and batch.tokens.shape[0] > self.in_turn_above:
            jax.block_until_ready(out)
        return InflightStep(so, batch, row_states, out, t0, t1, time.perf_counter(), prompt,
                            pooled)

    def _place_adapters(self, so: SchedulerOutput) -> None:
        """Every row's adapter into a device slot (loading the missing ones); each
        state's lora_slot for this step."""
        assert self.lora_slots is not None
        rows = [self.states[n.req_id] for n in so.scheduled_new_reqs] + \
               [self.states[c.req_id] for c in so.scheduled_cached_reqs]
        for st, slot in zip(rows, self.lora_slots.slots_for(self.weights,
                                                            [st.lora for st in rows])):
            st.lora_slot = slot

    def apply_proposals(self, so: SchedulerOutput, proposals: Proposals) -> None:
        """Take a drafter's proposals: their values into the step's proposal slots, and
        what proposing changed on the device (the shared KV, the proposals' q)."""
        so.scheduled_spec_decode_tokens.update(proposals.tokens)
        if proposals.kv is not None:
            self.kv = proposals.kv
        if proposals.draft_probs is not None:
            self.sampler_state = replace(self.sampler_state,
                                         draft_probs=proposals.draft_probs)

    def _pack(self, batch: StepBatch, sampling: Any, so: SchedulerOutput | None) -> Any:
        """The step's inputs in one buffer; with multi-step decode on, every step of a
        bucket that multi-step batches use says how many decode steps it runs, and each
        (sampling) row (one layout per bucket: no program per count). so None: a
        warm-up batch (one step, no rows)."""
        num_steps = so.num_steps if so is not None else 1
        if self.decode_steps == 1 or batch.tokens.shape[0] > self._multi_bucket:
            assert num_steps == 1, "multi-step decode is off for this bucket"
            return pack(batch=(batch.tokens, batch.md), sampling=sampling, feed=batch.feed)
        assert 1 <= num_steps <= self.decode_steps, num_steps
        rows = np.zeros(sampling.valid.shape[0], np.int32)
        if so is not None:
            rows[:len(batch.row_req_ids)] = _row_steps(so, batch)
        return pack(batch=(batch.tokens, batch.md), sampling=sampling, feed=batch.feed,
                    steps=(np.array([num_steps], np.int32), rows))

    def collect(self, step: InflightStep) -> StepResult:
        """Wait for a dispatched step's sampled tokens and append them to the request
        states. A request finished or preempted since the dispatch (its state dropped
        by a later dispatch) gets nothing: its extra token is dropped."""
        batch = step.batch
        t2 = time.perf_counter()
        # the logprob arrays come over only for a step with a row that asked for them
        # (three transfers fewer per decode step otherwise)
        want_lp = any(st.sampling_params.logprobs is not None for st in step.row_states)
        got, prompt_out, pooled_out = jax.device_get((
            step.out if want_lp else step.out.token_ids, step.prompt and step.prompt[0],
            step.pooled and step.pooled[0]))
        out = got if want_lp else replace(step.out, token_ids=got)
        t3 = time.perf_counter()
        for prow in (step.prompt[1] if step.prompt else ()):
            st = prow.state
            if self.states.get(st.req_id) is st and st.prompt_logprobs is not None:
                st.prompt_logprobs.extend(prompt_lp.entries(prompt_out, prow))
        if step.pooled:
            pool_rows.StepPooler.add(step.pooled[1], pooled_out, self.states)
        # multi-step decode: outputs stacked [decode_steps, rows], row r's first k_r filled
        row_steps = _row_steps(step.so, batch) if out.token_ids.ndim == 2 else None
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, Any] = {}
        prompt_logprobs: dict[str, list] = {}
        pooled: dict[str, np.ndarray] = {}
        for row, st in enumerate(step.row_states):
            rid = st.req_id
            if batch.row_samples[row] and self.states.get(rid) is st:
                g, n = _logit_range(batch, row)
                at: list[tuple[int | None, int]]    # (decode step, logit row) per token
                if row_steps is not None:       # one token per decode step, no proposals
                    k = int(row_steps[row])
                    toks = [int(t) for t in out.token_ids[:k, g]]
                    at = [(i, g) for i in range(k)]
                else:
                    # its logit rows [g, g + n): n - 1 proposals verified (speculative
                    # decoding); the accepted prefix and one more token come back, then -1s
                    toks = [int(t) for t in out.token_ids[g:g + n]]
                    toks = toks[:toks.index(-1)] if -1 in toks else toks
                    at = [(None, g + i) for i in range(len(toks))]
                    # rejected proposals: the scheduler rolls num_computed_tokens back
                    # and the next step's diff carries it here
                st.token_ids.extend(toks)
                sampled[rid] = toks
                if st.sampling_params.logprobs is not None:
                    logprobs[rid] = [sampler_mod.row_logprobs(
                        out if i is None else jax.tree_util.tree_map(lambda a: a[i], out),
                        r, st.sampling_params.logprobs)[0] for i, r in at]
                if st.prompt_logprobs is not None:
                    prompt_logprobs[rid], st.prompt_logprobs = st.prompt_logprobs, None
                if st.pool is not None:
                    pooled[rid], st.pool = st.pool.result(), None
        t4 = time.perf_counter()
        return StepResult(sampled, logprobs, (step.t_launch - step.t_start) + (t4 - t3),
                          t3 - step.t_launch, t3 - t2, step.t_launched - step.t_launch,
                          prompt_logprobs, pooled)

    def _sampling_inputs(self, batch: StepBatch, states: dict, step: int,
                         mask_rows: dict[str, bytes]) -> Any:
        """The step's sampling inputs, padded to the sampler's row bucket (every token
        bucket with rows in the same bucket shares one sampler program)."""
        rows = self.buckets.sampler_rows(batch.row_slots.shape[0])
        return sampler_mod.build_inputs(batch, states, self.cfg.vocab_size, step,
                                        self.spec_width, self._token_mask(batch, mask_rows, rows),
                                        num_rows=rows, pad_slot=self.pad_slot)

    def _token_mask(self, batch: StepBatch, rows: dict[str, bytes],
                    num_rows: int) -> np.ndarray | None:
        """[num_rows, W] int32 token bitmask of a step: all ones, but the constrained rows'
        (their scheduler-filled rows at their logit row); None without structured outputs."""
        if not self.mask_words:
            return None
        mask = np.full((num_rows, self.mask_words), -1, np.int32)
        for r, rid in enumerate(batch.row_req_ids):
            words = rows.get(rid)
            if words is not None:
                g, n = _logit_range(batch, r)
                assert n == 1, "a constrained row does not speculate"
                mask[g] = np.frombuffer(words, np.int32)
        return mask

    # ---- warm-up ---------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> float:
        """Compile every (T, P) bucket ahead of time (nothing is executed, so with the
        persistent compilation cache a second start only loads executables); returns
        seconds spent."""
        t0 = time.perf_counter()
        self._commit_state()
        if self.lora_slots is not None:     # its arrays committed before any step compiles
            self.lora_slots.warmup(self.weights)
        shapes = self.buckets.all_shapes()
        self._compile_shapes(shapes, progress)
        if self.drafter is not None:
            self.drafter.compile_propose()
        # The sampler's per-slot reset is its own small jitted function: compile it too.
        self._set_prompt(self.pad_slot, [0], 1)
        self.sampler_state = replace(self.sampler_state, automaton=self.automata.warmup(
            self.sampler_state.automaton, self.pad_slot))
        jax.block_until_ready(self.sampler_state)
        secs = time.perf_counter() - t0
        store = self.executables
        log.info("warm-up: %d shapes (tokens %s x block-table widths %s) in %.1f s; "
                 "%d programs compiled%s", len(shapes), list(self.buckets.token_buckets),
                 list(self.buckets.block_buckets), secs, self.num_compiles,
                 f", {store.loaded} loaded from {store.dir}" if store is not None else "")
        return secs

    def _commit_state(self) -> None:
        """Without a sharding plan, place the KV cache, the step state and the key on the
        weights' device, committed. jit keys its cache on whether an argument is committed:
        arrays fresh from jnp.zeros are not, a jitted step's outputs are, so programs
        compiled ahead of time for the fresh arrays missed at the first real steps (whose
        inputs are earlier outputs) and compiled again, a few seconds at a cold start.
        (A plan places them committed already.)"""
        placed = [a for a in jax.tree_util.tree_leaves(self.weights)
                  if isinstance(a, jax.Array) and getattr(a, "committed", True)]
        if self.plan is not None or not placed:     # host weights: jit places them
            return
        dev = next(iter(placed[0].devices()))
        self.kv, self.sampler_state, self.base_key = jax.device_put(
            (self.kv, self.sampler_state, self.base_key), dev)

    def _compile_shapes(self, shapes: list[tuple[int, int]], progress: bool) -> None:
        """Compile every (T, P) step shape. XLA compiles one program on one core, so
        shapes compile side by side, one per core (jax traces and compiles thread-safely;
        the step's caches take a lock; with a drafter, in turn)."""
        workers = max(1, min(WARMUP_THREADS, os.cpu_count() or 1, len(shapes)))
        if self.drafter is not None:
            workers = 1
        # the compiling threads take the caller's default device, or the real steps
        # would not match the compiled ones
        compile_shape = _under_callers_device(self._compile_shape)
        with tqdm(total=len(shapes), desc="warm-up (compiling buckets)",
                  disable=not progress, unit="shape") as bar:
            if workers == 1:
                for t, p in shapes:
                    compile_shape(t, p)
                    bar.update()
                return
            with ThreadPoolExecutor(workers, thread_name_prefix="warmup") as pool:
                for done in as_completed([pool.submit(compile_shape, t, p)
                                          for t, p in shapes]):
                    done.result()
                    bar.update()

    def _compile_shape(self, t: int, p: int) -> None:
        """Compile the step (and the drafter's mirror) for T tokens, P block-table width;
        with the first width and an embedding model, also T's pooling program."""
        if p == self.buckets.block_buckets[0] and self.pooler is not None:
            self.pooler.compile(t, head_weights(self.weights), self.weights["embed"])
        batch = StepBatch.dummy(t, self.buckets.rows_for(t), p, self.num_blocks,
                                self.block_size, self.pad_slot,
                                self.backend.needs_full_block_tables,
                                lora=self.lora_slots is not None)
        sampling = self._sampling_inputs(batch, {}, 0, {})
        dev = self._pack(batch, sampling, None).to_device(self._input_sharding)
        self._step.compile(self.weights, self.kv, dev, self.sampler_state, self.base_key,
                           self.plans)
        if self.drafter is not None:
            self.drafter.compile_mirror(dev, self.sampler_state)


def _under_callers_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, to be run on another thread under the calling thread's default device (jax
    keeps it per thread: a data-parallel replica builds its runner under its own)."""
    device = jax.config.jax_default_device

    def run(*args: Any) -> Any:
        if device is None:
            return fn(*args)
        with jax.default_device(device):
            return fn(*args)
    return run


def _row_steps(so: SchedulerOutput, batch: StepBatch) -> np.ndarray:
    """[rows] int32 the decode steps each row runs: its tokens in a multi-step decode
    step (k_r), else 1."""
    return np.array([so.tokens_sampled(r) for r in batch.row_req_ids], np.int32)


def _logit_range(batch: StepBatch, row: int) -> tuple[int, int]:
    """(first logit row, count) of a request row."""
    if batch.logit_start is None:
        return row, 1
    g = int(batch.logit_start[row])
    return g, int(batch.logit_start[row + 1]) - g
