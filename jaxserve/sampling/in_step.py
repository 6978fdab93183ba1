"""The runner's side of the sampler: per-step inputs and the in-step sampling call.

The sampler state (penalty counts) lives on the device in persistent request slots;
the runner sets a slot's prompt when a request (re)starts there, and the jitted step
records every sampled token. The step's random key is derived inside the step from
the runner's base key and the step counter (sent with the other inputs), so no key is
split on the host and transferred.

Work no row needs is skipped one of two ways (StepPlan, static; sampler.py says why):
branched (CPU, TPU): logprobs and the sampler's optional passes sit under lax.cond, one
program for every mix of settings; branch-free (GPU): the host picks one of a few
programs (all_plans) from the step's flags, and nothing in them is conditional; by
default a runner compiles only GENERAL_PLAN of them (warmup_plans), one sampler program
per row count, since the sampler is a small part of a step while every plan is one
more compile at warm-up.

Sampling rows are the step's logit rows (step_inputs.py): one per request row, or
k + 1 for a row verifying k proposed tokens. With speculation configured (spec_width
> 0) the inputs carry SpecInputs and each logit row's preceding proposals (penalties
count them), and sample() emits only the accepted prefix (sampling/rejection.py;
with a device drafter, sampled rows by the general rule: _verify_drafted); tokens of
logit rows not emitted come back as -1.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling import penalties
from jaxserve.sampling.bitmask import ALL_ALLOWED, mask_logits
from jaxserve.sampling.logprobs import compute_logprobs, logprob_dict
from jaxserve.sampling.metadata import SamplingMetadata, build_sampling_metadata
from jaxserve.sampling.sampler import BRANCHED, SamplerOutput, SamplerPlan
from jaxserve.sampling.sampler import sample as _sample
from jaxserve.sampling import rejection, rejection_general


@struct.dataclass
class SamplingInputs:
    md: SamplingMetadata
    slots: jax.Array          # [R] int32 persistent slot of each row
    valid: jax.Array          # [R] bool row samples a real token this step
    any_logprobs: jax.Array   # [] bool some row asked for logprobs
    step: jax.Array           # [] int32 step counter: this step's key is fold_in(base, step)
    spec: rejection.SpecInputs | None = None   # speculation configured (static per engine)
    # [R, W] int32 token bitmask (sampling/bitmask.py; all ones: unconstrained), present
    # when the engine serves structured outputs (static per engine)
    token_mask: jax.Array | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """The static sampling program of a step."""
    sampler: SamplerPlan = BRANCHED
    logprobs: bool = True     # branch-free: compute logprobs (branched: a cond decides)


BRANCHED_PLAN = StepPlan()


def plan_for(inputs: SamplingInputs) -> StepPlan:
    """Host: the branch-free plan for a step's (numpy) inputs."""
    return StepPlan(SamplerPlan.for_step(inputs.md), bool(inputs.any_logprobs))


# branch-free: the plan that serves every step (random and exact-search rows, logprobs);
# the others only skip work, so a step may always run this one instead
GENERAL_PLAN = StepPlan(SamplerPlan(False, sample=True, exact=True), logprobs=True)


def warmup_plans(branch: bool, every: bool = False) -> list[StepPlan]:
    """The plans a runner compiles and runs: one program per sampler row count
    (branched, or branch-free GENERAL_PLAN); every=True (branch-free): all_plans, the
    host picking the lightest for each step (plan_for), at 6x the sampler programs."""
    if branch:
        return [BRANCHED_PLAN]
    return all_plans(False) if every else [GENERAL_PLAN]


def all_plans(branch: bool) -> list[StepPlan]:
    """Every plan a runner may use: one when branching, else the branch-free programs
    (greedy, sampling, sampling with the exact search; each with and without logprobs)."""
    if branch:
        return [BRANCHED_PLAN]
    samplers = [SamplerPlan(False, sample=False, exact=False),
                SamplerPlan(False, sample=True, exact=False),
                SamplerPlan(False, sample=True, exact=True)]
    return [StepPlan(s, lp) for s in samplers for lp in (False, True)]


def init_state(num_slots: int, vocab: int) -> penalties.PenaltyState:
    return penalties.init_penalty_state(num_slots, vocab)


@partial(jax.jit, donate_argnums=(0,))
def _start_slot(state, buf):
    slot, num_prompt, num_total, ids = buf[0], buf[1], buf[2], buf[3:]
    state = penalties.set_prompt(state, slot, ids, num_prompt)
    out_ids = jnp.roll(ids, -num_prompt)      # outputs so far (a request resumed after preemption)
    return penalties.set_outputs(state, slot, out_ids, num_total - num_prompt)


def set_prompt(state: Any, slot: int, token_ids: list[int], num_prompt: int,
               pad_to: int) -> Any:
    """(Re)start `slot` with a request's prompt (and outputs so far). ids are padded
    to one static length so this never recompiles; one transfer ([slot, num_prompt,
    num_tokens, ids...])."""
    buf = np.zeros(pad_to + 3, np.int32)
    buf[:3] = slot, num_prompt, len(token_ids)
    buf[3:3 + len(token_ids)] = token_ids
    return _start_slot(state, jax.device_put(buf))


def build_inputs(batch: Any, states: Mapping[str, Any], vocab: int,
                 step: int = 0, spec_width: int = 0,
                 token_mask: np.ndarray | None = None, num_rows: int | None = None,
                 pad_slot: int = -1) -> SamplingInputs:
    """Host (numpy) sampling inputs of a step batch, one sampling row per logit row;
    step: the runner's step counter; spec_width: num_speculative_tokens (0: off);
    num_rows: the sampler's rows (buckets.sampler_rows), >= the batch's: the rows past
    the batch's are padding (invalid, greedy, slot `pad_slot`); token_mask has them."""
    R = num_rows or batch.row_slots.shape[0]
    assert R >= batch.row_slots.shape[0] and (R == batch.row_slots.shape[0] or pad_slot >= 0)
    sts = [states[r] for r in batch.row_req_ids]
    start = getattr(batch, "logit_start", None)
    if start is None or int(start[-1]) == len(sts):     # one logit row per row
        owner, offset = np.arange(len(sts)), np.zeros(len(sts), np.int64)
        slots = batch.row_slots
    else:
        per_row = np.diff(start)
        owner = np.repeat(np.arange(len(sts)), per_row)
        offset = np.arange(len(owner)) - start[owner]
        slots = batch.logit_slots
    rows = [sts[r] for r in owner]
    md = build_sampling_metadata([s.sampling_params for s in rows],
                                 [s.output_len + int(j) for s, j in zip(rows, offset)],
                                 [s.eos_token_ids for s in rows], R, vocab)
    if len(slots) < R:
        slots = np.concatenate([slots, np.full(R - len(slots), pad_slot, slots.dtype)])
    valid = np.zeros(R, bool)
    valid[:len(rows)] = np.asarray(batch.row_samples, bool)[owner]
    any_lp = any(s.sampling_params.logprobs is not None for s in sts)
    spec = None
    if spec_width > 0:
        spec, prev = _spec_inputs(batch, owner, offset, R, spec_width, vocab)
        md = dataclasses.replace(md, prev_draft_ids=prev)
    return SamplingInputs(md, slots, valid, np.bool_(any_lp),
                          np.int32(step % (1 << 31)), spec, token_mask=token_mask)


def _spec_inputs(batch: Any, owner: np.ndarray, offset: np.ndarray, R: int, width: int,
                 vocab: int) -> tuple[rejection.SpecInputs, np.ndarray]:
    """SpecInputs and, per logit row j of a row, its proposals d1..dj (pad vocab) [R, W]."""
    spec = rejection.empty_spec_inputs(R)
    prev = np.full((R, width), vocab, np.int32)
    drafts = getattr(batch, "drafts", None) or []
    start = getattr(batch, "logit_start", None)
    if not any(drafts):
        return spec, prev
    for g, (r, j) in enumerate(zip(owner, offset)):
        d = drafts[r] if r < len(drafts) else []
        if not d or len(d) + 1 != int(start[r + 1] - start[r]):
            continue
        spec.row_first[g] = start[r]
        if j < len(d):
            spec.next_draft[g] = d[j]
        prev[g, :j] = d[:j]
    return spec, prev


def sample(logits: jax.Array, inputs: SamplingInputs, state: Any, base_key: jax.Array, *,
           num_logprobs: int, plan: StepPlan = BRANCHED_PLAN,
           draft_probs: jax.Array | None = None) -> tuple[SamplerOutput, Any]:
    """Sample (and verify) each logit row, record the emitted tokens -> (out, state').
    draft_probs [S, K, V]: a device drafter's q of each slot's proposals (None: no device
    drafter; worker/drafter/draft_step.py)."""
    out, emitted = choose(logits, inputs, state, base_key, num_logprobs=num_logprobs,
                          plan=plan, draft_probs=draft_probs)
    return record(out, emitted, inputs, state)


def record(out: SamplerOutput, emitted: jax.Array, inputs: SamplingInputs,
           state: Any) -> tuple[SamplerOutput, Any]:
    """The penalty state with the emitted tokens counted; a speculating row's tokens not
    emitted become -1."""
    state = penalties.record_tokens(state, inputs.slots, out.token_ids, emitted)
    if inputs.spec is not None:
        out = dataclasses.replace(out, token_ids=jnp.where(emitted, out.token_ids, -1))
    return out, state


def choose(logits: jax.Array, inputs: SamplingInputs, state: Any, base_key: jax.Array, *,
           num_logprobs: int, plan: StepPlan = BRANCHED_PLAN,
           draft_probs: jax.Array | None = None) -> tuple[SamplerOutput, jax.Array]:
    """sample() before recording: (out, emitted [R] bool); the state is only read."""
    key = jax.random.fold_in(base_key, inputs.step)
    # disallowed tokens (structured outputs) are -inf before anything else; logprobs
    # below stay those of the raw logits (vLLM's default)
    masked = mask_logits(logits, inputs.token_mask, branch=plan.sampler.branch)
    out = _sample(masked, inputs.md, state, inputs.slots, key, plan=plan.sampler)
    tokens, emitted = out.token_ids, inputs.valid
    if inputs.spec is not None:     # keep the accepted prefix of each speculating row
        emitted = rejection.emitted_mask(tokens, inputs.valid, inputs.spec)
        if draft_probs is not None and plan.sampler.sample:
            tokens, emitted = _verify_drafted(logits, tokens, emitted, inputs, state,
                                              draft_probs, key, plan)
    R = logits.shape[0]
    n = num_logprobs

    def with_lp():
        return compute_logprobs(logits.astype(jnp.float32), tokens, n)

    def without_lp():
        return (jnp.zeros((R, n + 1), jnp.float32), jnp.zeros((R, n + 1), jnp.int32),
                jnp.zeros((R,), jnp.int32))
    if plan.sampler.branch:
        lp, lp_ids, rank = jax.lax.cond(inputs.any_logprobs, with_lp, without_lp)
    else:
        lp, lp_ids, rank = with_lp() if plan.logprobs else without_lp()
    return SamplerOutput(tokens, lp, lp_ids, rank), emitted


def plain_greedy(inputs: SamplingInputs) -> jax.Array:
    """[] bool: every row's token is the argmax of its raw logits and nothing else of the
    logits is needed (all rows greedy; no penalty, logit bias or suppressed stop ids, no
    logprobs, no constrained row). Speculation is the caller's static check."""
    md = inputs.md
    ok = md.all_greedy & ~md.any_penalty & ~md.any_bias & ~inputs.any_logprobs
    if inputs.token_mask is not None:
        ok = ok & ~jnp.any(inputs.token_mask != ALL_ALLOWED)
    return ok


def greedy_choice(tokens: jax.Array, inputs: SamplingInputs, *,
                  num_logprobs: int) -> tuple[SamplerOutput, jax.Array]:
    """What choose() returns for a plain_greedy step whose argmax tokens [R] are known
    (model/cpu/greedy_head.py): the tokens, no logprobs, every valid row emitted."""
    R, n = tokens.shape[0], num_logprobs
    out = SamplerOutput(tokens, jnp.zeros((R, n + 1), jnp.float32),
                        jnp.zeros((R, n + 1), jnp.int32), jnp.zeros((R,), jnp.int32))
    return out, inputs.valid


def _verify_drafted(logits: jax.Array, tokens: jax.Array, emitted: jax.Array,
                    inputs: SamplingInputs, state: Any, draft_probs: jax.Array,
                    key: jax.Array, plan: StepPlan) -> tuple[jax.Array, jax.Array]:
    """(tokens, emitted) with the sampled rows' proposals from a device drafter verified
    by the general rule (rejection_general.verify_rows): their drafter drew them from q
    (draft_probs[slot, j]), not as its argmax. Greedy rows keep argmax matching (the
    drafter proposed their argmax), and so do seeded rows: their emitted tokens stay plain
    decoding's (the general rule's depend on where steps start, which a prefix-cache hit
    or the token budget moves). p is sampling_probs: what the sampler draws from."""
    spec, md = inputs.spec, inputs.md
    first = spec.row_first
    drafted = (inputs.valid & (spec.next_draft[first] >= 0) & (md.temperature > 0)
               & ~md.has_seed)

    def verify() -> tuple[jax.Array, jax.Array]:
        p = rejection_general.sampling_probs(
            mask_logits(logits, inputs.token_mask, branch=plan.sampler.branch), md, state,
            inputs.slots, plan=plan.sampler)
        j = jnp.arange(logits.shape[0]) - first
        q = draft_probs[inputs.slots, jnp.clip(j, 0, draft_probs.shape[1] - 1)]
        keys = rejection_general.row_keys(md.seed, md.has_seed, md.output_pos, key)[first]
        v = rejection_general.verify_rows(p, q, spec.next_draft, first, keys,
                                          jnp.zeros_like(drafted), drafted)
        return (jnp.where(drafted & v.emitted, v.tokens, tokens),
                jnp.where(drafted, v.emitted, emitted))
    if plan.sampler.branch:
        return jax.lax.cond(jnp.any(drafted), verify, lambda: (tokens, emitted))
    return verify()


def row_logprobs(out: SamplerOutput, row: int, k: int) -> list[dict]:
    """Host: the logprobs entry of one sampled token (sampled + top k)."""
    return [logprob_dict(out.logprobs[row], out.logprob_token_ids[row],
                         int(out.sampled_rank[row]), k)]
