"""The device step, in compiled forms with one signature:

    step(weights, kv, packed, sampler_state, base_key, plan) -> (out, kv', sampler_state')

packed (packing.Packed) holds the step's inputs in one int32 buffer, section "batch"
(tokens, AttentionMetadata) and section "sampling" (in_step.SamplingInputs), sent
in one transfer; plan (in_step.StepPlan, static) is the sampling program.

* FusedStep: the whole step (all layers, logits, sampler) is one jitted function.
  Best where dispatch is expensive and XLA can overlap layers (GPU/TPU). Branch-free
  (GPU, branch=False: no lax.cond, whose predicate XLA:GPU reads on the host) it is two
  programs, launched back to back without a host sync: the forward pass (one per
  bucket, as before) and the sampler chosen by the plan (a few small programs per row
  count), so the plans multiply only the small programs.
* LayerwiseStep and HybridStep (worker/layerwise_step.py): groups of layers per
  call, and the two forms side by side by bucket size.
* Multi-step decode (FusedStep, branched, decode_steps > 1): the packed inputs carry a
  "steps" section, and the step is a device loop of k <= decode_steps whole steps
  (layers, head, sampler), each fed the tokens the one before sampled, the metadata
  advanced on the device (advance_decode); k is an input, so there is still one program
  per bucket, and k = 1 is an ordinary step. Outputs come back stacked per decode step.
All donate the KV buffers and the sampler state; all count traces (= compilations).
Each jitted function sits in a Program (worker/executables.py): with an executable
store, warm-up loads or compiles an executable per dispatch key and the steps call it
(no trace at a second start); without one, jit's own caches, as before.
All keep the call's last-layer hidden states [T, D] (before the final norm) in
`last_hidden` for the prompt-logprob program (sampling/prompt_logprobs.py) and the
pooling program of embeddings (model/pooling.py), which the runner runs after the steps
that need them.

The runner's sampler state is a StepState: the penalty state plus each slot's last
sampled token, which the step writes and the next step reads where the packed inputs
have a "feed" section saying so (a token sampled by a step whose results the host has
not seen yet: asynchronous scheduling). A bare penalty state and no "feed" section
(export_check's abstract inputs) skip both.
With a sharding plan both pin their output shardings (plan.step_jit_kwargs /
plan.layerwise_jit_kwargs), so every call sees the shardings of the first.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

from flax import struct
import jax
import jax.numpy as jnp

from jaxserve.sampling import in_step
from jaxserve.worker.executables import ExecutableStore, Program
from jaxserve.worker.packing import Packed
from jaxserve.sampling.in_step import StepPlan
from jaxserve.model import decoder
from jaxserve.model.cpu import greedy_head
from jaxserve.sampling.sampler import SamplerOutput
from jaxserve.structured import device_step
from jaxserve.sampling import rejection

_STATIC_PLAN = dict(static_argnames=("plan",))


@struct.dataclass
class StepState:
    """The sampler state the step carries from one step to the next (donated)."""
    penalties: Any                 # sampling.penalties.PenaltyState
    last_tokens: jax.Array         # [S] int32 each slot's latest sampled token
    automaton: Any = None          # structured.device_pool.AutomatonPool (or None)
    # [S, K, V] f32 a device drafter's q of each slot's proposals (worker/drafter/draft.py
    # allocates it, its proposal program writes it, the step reads it); None otherwise
    draft_probs: Any = None


def split_state(state: Any) -> tuple[Any, Any]:
    """(penalty state, last tokens or None)."""
    if isinstance(state, StepState):
        return state.penalties, state.last_tokens
    return state, None


def _join(penalties: Any, last: Any, automaton: Any = None, draft_probs: Any = None) -> Any:
    return penalties if last is None else StepState(penalties, last, automaton, draft_probs)


def _sample(logits: Callable[[], Any], inputs: in_step.SamplingInputs, sampler_state,
            base_key, num_logprobs: int, plan: StepPlan,
            greedy_ids: Callable[[], Any] | None = None):
    """Sample each row (a row with an on-device structured-output automaton under its
    state's allowed tokens), record the tokens, advance the automata -> (out, state').
    logits: the step's logits [R, V] (a thunk: computed only where needed); greedy_ids:
    the argmax of each row's logits [R] without them (model/cpu/greedy_head.py), taken by a
    lax.cond when no row needs more than that (in_step.plain_greedy), or None."""
    pen, last = split_state(sampler_state)
    pool = device_step.pool_of(sampler_state)
    if pool is not None:        # the device rows' words join the host path's token mask
        inputs = dataclasses.replace(inputs, token_mask=device_step.row_words(
            pool, inputs.slots, inputs.token_mask))
    q = getattr(sampler_state, "draft_probs", None)

    def full():
        return in_step.choose(logits(), inputs, pen, base_key,
                                    num_logprobs=num_logprobs, plan=plan, draft_probs=q)
    if greedy_ids is not None and q is None and inputs.spec is None and plan.sampler.branch:
        # the state is recorded after the cond (its branches only read it)
        out, emitted = jax.lax.cond(
            in_step.plain_greedy(inputs),
            lambda: in_step.greedy_choice(greedy_ids(), inputs,
                                                num_logprobs=num_logprobs), full)
    else:
        out, emitted = full()
    out, pen = in_step.record(out, emitted, inputs, pen)
    pool = device_step.advance(pool, inputs.slots, out.token_ids, inputs.valid)
    return out, _join(pen, _record_last(last, inputs, out.token_ids), pool, q)


def sampler_rows(logits: Any, packed: Packed) -> Any:
    """The step's logits [R, V] padded with zero rows to the sampler's rows (its sampling
    inputs', buckets.sampler_rows; the padding rows are invalid there)."""
    rows = packed.unpack("sampling").valid.shape[0]
    return jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0)))


def fed_tokens(tokens: Any, packed: Packed, last: Any) -> Any:
    """The host's tokens, with the fed positions replaced by their slot's last token."""
    if last is None or "feed" not in dict(packed.layout.sections):
        return tokens
    feed = packed.unpack("feed")
    return jnp.where(feed >= 0, last[jnp.clip(feed, 0, last.shape[0] - 1)], tokens)


def _record_last(last: Any, inputs: in_step.SamplingInputs, token_ids: Any) -> Any:
    """Write each sampling row's token into its slot (other rows change nothing)."""
    if last is None:
        return None
    idx = jnp.where(inputs.valid, inputs.slots, last.shape[0])
    if inputs.spec is not None:     # a speculating row: its last emitted token only
        idx = jnp.where(rejection.last_emitted(token_ids, inputs.spec), idx, last.shape[0])
    return last.at[idx].set(token_ids.astype(last.dtype), mode="drop")


def advance_decode(md: Any, i: Any, block_size: int, row_steps: Any = None,
                   no_slot: int = 0) -> Any:
    """A decode batch's metadata (one token per row) moved i steps on: every real
    token's position + i and its KV slot there (from the row's block table), every
    real row's lengths + i. i = 0 gives md back. row_steps [>= R]: the decode steps
    each row runs; a row past its last writes no KV (slot no_slot: out of range)."""
    R, P = md.seq_lens.shape[0], md.block_tables.shape[1]
    if P == 0:              # a bucket without context: never a decode step
        return md
    real = md.token_rows < R
    pos = jnp.where(real, md.positions + i, md.positions)
    rows = jnp.clip(md.token_rows, 0, R - 1)
    block = md.block_tables[rows, jnp.clip(pos // block_size, 0, P - 1)]
    slots = jnp.where(real & (i > 0), block * block_size + pos % block_size,
                      md.slot_mapping)
    if row_steps is not None:
        slots = jnp.where(real & (i >= row_steps[rows]), no_slot, slots)
    live = md.seq_lens > 0
    return dataclasses.replace(
        md, positions=pos, slot_mapping=slots,
        context_lens=jnp.where(live, md.context_lens + i, md.context_lens),
        seq_lens=jnp.where(live, md.seq_lens + i, md.seq_lens))


def _advance_sampling(inputs: in_step.SamplingInputs, i: Any, row_steps: Any
                      ) -> in_step.SamplingInputs:
    """The sampling inputs i decode steps on: each row's output position + i (its seed's
    draw, min_tokens) and the step counter + i (the key of unseeded draws); a row past
    its last step samples nothing (records no token, advances no automaton)."""
    md = dataclasses.replace(inputs.md, output_pos=inputs.md.output_pos + i)
    return dataclasses.replace(inputs, md=md, step=inputs.step + i,
                               valid=inputs.valid & (i < row_steps))


class FusedStep:
    def __init__(self, cfg: Any, inv_freq: Any, attn_fn: Any, num_logprobs: int,
                 on_trace: Callable[[], None], jit_kwargs: dict | None = None,
                 branch: bool = True, decode_steps: int = 1, block_size: int = 0,
                 num_kv_slots: int = 0, store: ExecutableStore | None = None) -> None:
        """decode_steps > 1 (branched only): steps whose packed inputs have a "steps"
        section run up to that many decode steps back to back in one program (multi-step
        decode, _multi_impl); block_size, num_kv_slots: the KV cache's, for their slots.
        store: where compiled programs are kept across starts (or None)."""
        self.cfg, self.inv_freq, self.attn_fn = cfg, inv_freq, attn_fn
        self.num_logprobs, self.on_trace, self.branch = num_logprobs, on_trace, branch
        assert decode_steps == 1 or (branch and block_size > 0 and num_kv_slots > 0)
        self.decode_steps, self.block_size = decode_steps, block_size
        self.num_kv_slots = num_kv_slots
        self.last_hidden: Any = None
        kw = dict(jit_kwargs or {})
        if branch:
            if "out_shardings" in kw:       # + the hidden states, replicated like `out`
                kw["out_shardings"] = (*kw["out_shardings"], kw["out_shardings"][0])
            self._fn = jax.jit(self._impl, donate_argnames=("kv", "sampler_state"),
                               **_STATIC_PLAN, **kw)
            self._prog = Program(self._fn, "fused", store, donate=(1, 3))
            return
        outs = kw.pop("out_shardings", None)     # (out, kv, sampler_state) -> split
        self._rep = outs[0] if outs is not None else None
        fwd_kw = dict(kw, out_shardings=(outs[0], outs[0], outs[1], outs[0])) if outs else kw
        samp_kw = dict(kw, out_shardings=(outs[0], outs[2])) if outs else kw
        self._fn = jax.jit(self._forward_impl, donate_argnames=("kv",), **fwd_kw)
        self._prog = Program(self._fn, "forward", store, donate=(1,))
        self._sampler = SamplerProgram(num_logprobs, on_trace, samp_kw, store)

    def _head(self, weights, x, md, packed):
        """The final norm of the logit rows, then (logits thunk [R, V], greedy-ids thunk
        [R] or None: model/cpu/greedy_head.py), R the sampler's rows."""
        h = decoder.final_norm(weights, x[md.logits_indices], self.cfg)

        def logits():
            return sampler_rows(decoder.compute_logits(
                weights, h, self.cfg.linear, self.cfg.final_logit_softcap), packed)
        if not greedy_head.usable(weights, self.cfg, h.shape[0]):
            return logits, None

        def ids():
            rows = packed.unpack("sampling").valid.shape[0]
            return jnp.pad(greedy_head.greedy_ids(weights, h), (0, rows - h.shape[0]))
        return logits, ids

    def _forward(self, weights, kv, packed, last=None):
        tokens, md = packed.unpack("batch")
        tokens = fed_tokens(tokens, packed, last)
        hidden, kv = decoder.layers_forward(weights, kv, tokens, md, self.cfg, self.inv_freq,
                                            self.attn_fn)
        return self._head(weights, hidden, md, packed), kv, hidden

    def _impl(self, weights, kv, packed, sampler_state, base_key, plan):
        self.on_trace()
        if "steps" in dict(packed.layout.sections):
            return self._multi_impl(weights, kv, packed, sampler_state, base_key, plan)
        (logits, ids), kv, hidden = self._forward(weights, kv, packed,
                                                  split_state(sampler_state)[1])
        out, sampler_state = _sample(logits, packed.unpack("sampling"), sampler_state,
                                     base_key, self.num_logprobs, plan, ids)
        return out, kv, sampler_state, hidden

    def _multi_impl(self, weights, kv, packed, sampler_state, base_key, plan):
        """Multi-step decode: packed.unpack("steps") = (k [1], k_r [rows]): k
        (1..decode_steps) steps in a loop, each the whole step (layers, head, sampler),
        row r taking part in the first k_r; the first reads the host's (or fed) tokens,
        each later one the tokens the one before sampled, one per row (a multi-step batch
        has only decode rows; k = 1 is any ordinary step). The outputs come back stacked,
        [decode_steps, rows, ...], row r's first k_r filled."""
        tokens0, md0 = packed.unpack("batch")
        tokens0 = fed_tokens(tokens0, packed, split_state(sampler_state)[1])
        inputs0 = packed.unpack("sampling")
        num_steps, row_steps = packed.unpack("steps")
        num_steps = num_steps[0]
        S, R, n = self.decode_steps, inputs0.valid.shape[0], self.num_logprobs
        outs = SamplerOutput(jnp.zeros((S, R), jnp.int32), jnp.zeros((S, R, n + 1), jnp.float32),
                             jnp.zeros((S, R, n + 1), jnp.int32), jnp.zeros((S, R), jnp.int32))
        # the loop carries the last iteration's hidden states (prompt logprobs: k = 1)
        hidden = decoder.embed_tokens(weights["embed"], tokens0, self.cfg)

        def body(carry):
            i, kv, state, outs, _ = carry
            prev = outs.token_ids[jnp.maximum(i - 1, 0)]
            fed = prev[jnp.clip(md0.token_rows, 0, R - 1)]
            tokens = jnp.where(i == 0, tokens0, fed)
            md = advance_decode(md0, i, self.block_size, row_steps, self.num_kv_slots)
            x, kv = decoder.layers_forward(weights, kv, tokens, md, self.cfg,
                                           self.inv_freq, self.attn_fn)
            logits, ids = self._head(weights, x, md, packed)
            out, state = _sample(logits, _advance_sampling(inputs0, i, row_steps), state,
                                 base_key, n, plan, ids)
            outs = jax.tree_util.tree_map(lambda a, o: a.at[i].set(o), outs, out)
            return i + 1, kv, state, outs, x.astype(hidden.dtype)

        _, kv, sampler_state, outs, hidden = jax.lax.while_loop(
            lambda c: c[0] < num_steps, body,
            (jnp.int32(0), kv, sampler_state, outs, hidden))
        return outs, kv, sampler_state, hidden

    def _forward_impl(self, weights, kv, packed, last=None):
        self.on_trace()
        (logits, _), kv, hidden = self._forward(weights, kv, packed, last)
        return logits(), packed.section("sampling"), kv, hidden

    def __call__(self, weights, kv, packed, sampler_state, base_key, plan: StepPlan):
        if self.branch:
            out, kv, sampler_state, self.last_hidden = self._prog(
                (packed.layout, plan), weights, kv, packed, sampler_state, base_key,
                plan=plan)
            return out, kv, sampler_state
        # the forward program reads the last tokens, the sampler program (next on the
        # device) donates and rewrites them
        logits, sampling, kv, self.last_hidden = self._prog(
            packed.layout, weights, kv, packed, split_state(sampler_state)[1])
        out, sampler_state = self._sampler(logits, sampling, sampler_state, base_key,
                                           plan=plan)
        return out, kv, sampler_state

    def compile(self, weights, kv, packed, sampler_state, base_key,
                plans: Sequence[StepPlan]) -> None:
        """Compile this input shape (and every plan) ahead of time (nothing runs, nothing
        is donated); later calls with the same shapes find it in jit's cache."""
        if self.branch:
            for plan in plans:
                self._prog.compile((packed.layout, plan), weights, kv, packed, sampler_state,
                                   base_key, plan=plan)
            return
        forward = self._prog.compile(packed.layout, weights, kv, packed,
                                     split_state(sampler_state)[1])
        self._sampler.compile(forward, packed, sampler_state, base_key, plans,
                              self._rep or committed_to(weights["embed"]))


class SamplerProgram:
    """The sampler as a program of its own, after a forward program that returns the
    logits and the packed inputs' sampling section: (logits, sampling, sampler_state,
    base_key, plan) -> (out, sampler_state'), the state donated. Its shapes depend on
    the row count only, so token buckets with the same rows share one compile."""

    def __init__(self, num_logprobs: int, on_trace: Callable[[], None],
                 jit_kwargs: dict, store: ExecutableStore | None = None) -> None:
        self.num_logprobs, self.on_trace = num_logprobs, on_trace
        self.fn = jax.jit(self._impl, donate_argnames=("sampler_state",), **_STATIC_PLAN,
                          **jit_kwargs)            # the jitted program (jax.export takes it)
        self._prog = Program(self.fn, "sampler", store, donate=(2,))
        self._compiled: set = set()
        self._lock = threading.Lock()      # warm-up compiles buckets from several threads

    def _impl(self, logits, sampling, sampler_state, base_key, plan):
        self.on_trace()
        return _sample(lambda: logits, sampling.unpack("sampling"), sampler_state, base_key,
                       self.num_logprobs, plan)

    def __call__(self, logits, sampling, sampler_state, base_key, plan: StepPlan):
        return self._prog((logits.shape, logits.dtype, sampling.layout, plan), logits,
                          sampling, sampler_state, base_key, plan=plan)

    def compile(self, forward: Any, packed: Packed, sampler_state: Any, base_key: Any,
                plans: Sequence[StepPlan], sharding: Any) -> None:
        """Compile (every plan) for the logits and sampling section the `forward` program
        (lowered or compiled) returns first, unless an earlier bucket with the same rows did. sharding:
        where the real logits live (committed, as a jitted program's outputs are, or the
        first real call would compile again)."""
        logits, sampling = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                            for a in jax.tree_util.tree_leaves(forward.out_info)[:2])
        sampling = Packed(sampling, packed.section_layout("sampling"))
        for plan in plans:
            key = (logits.shape, logits.dtype, sampling.layout, plan)
            with self._lock:
                if key in self._compiled:
                    continue
                self._compiled.add(key)
            self._prog.compile(key, logits, sampling, sampler_state, base_key, plan=plan)


def bucket_tokens(packed: Packed) -> int:
    """T, the step's token bucket (the length of the batch section's token array)."""
    return packed.layout["batch"].leaves[0][0][0]


def committed_to(a: Any) -> Any:
    """The single-device sharding of a committed device array (or a QArray's first
    leaf); None for host (numpy) weights, which jit places uncommitted."""
    leaf = jax.tree_util.tree_leaves(a)[0]
    if not isinstance(leaf, jax.Array) or not getattr(leaf, "committed", True):
        return None
    return jax.sharding.SingleDeviceSharding(next(iter(leaf.devices())))


def head_weights(weights: dict) -> dict:
    """What the head needs: final norm, embedding (tied head) and lm_head if untied (and
    head_packed: a tied head's copy for the CPU kernel, model/cpu/matmul.py)."""
    return {k: weights[k] for k in ("final_norm", "embed", "lm_head", "head_packed")
            if k in weights}
