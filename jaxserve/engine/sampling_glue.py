"""The runner's side of the sampler: per-step inputs and the in-step sampling call.

The sampler state (penalty counts) lives on the device in persistent request slots;
the runner sets a slot's prompt when a request (re)starts there, and the jitted step
records every sampled token. The step's random key is derived inside the step from
the runner's base key and the step counter (sent with the other inputs), so no key is
split on the host and transferred.

Work no row needs is skipped one of two ways (StepPlan, static; sampler.py says why):
branched (CPU, TPU): logprobs and the sampler's optional passes sit under lax.cond, one
program for every mix of settings; branch-free (GPU): the host picks one of a few
programs (all_plans) from the step's flags, and nothing in them is conditional.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling import penalties
from jaxserve.sampling.logprobs import compute_logprobs, logprob_dict
from jaxserve.sampling.metadata import SamplingMetadata, build_sampling_metadata
from jaxserve.sampling.sampler import BRANCHED, SamplerOutput, SamplerPlan
from jaxserve.sampling.sampler import sample as _sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    md: SamplingMetadata
    slots: jax.Array          # [R] int32 persistent slot of each row
    valid: jax.Array          # [R] bool row samples a real token this step
    any_logprobs: jax.Array   # [] bool some row asked for logprobs
    step: jax.Array           # [] int32 step counter: this step's key is fold_in(base, step)


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """The static sampling program of a step."""
    sampler: SamplerPlan = BRANCHED
    logprobs: bool = True     # branch-free: compute logprobs (branched: a cond decides)


BRANCHED_PLAN = StepPlan()


def plan_for(inputs: SamplingInputs) -> StepPlan:
    """Host: the branch-free plan for a step's (numpy) inputs."""
    return StepPlan(SamplerPlan.for_step(inputs.md), bool(inputs.any_logprobs))


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
                 step: int = 0) -> SamplingInputs:
    """Host (numpy) sampling inputs of a step batch; step: the runner's step counter."""
    R = batch.row_slots.shape[0]
    sts = [states[r] for r in batch.row_req_ids]
    md = build_sampling_metadata([s.sampling_params for s in sts], [s.output_len for s in sts],
                                 [s.eos_token_ids for s in sts], R, vocab)
    valid = np.zeros(R, bool)
    valid[:len(sts)] = batch.row_samples
    any_lp = any(s.sampling_params.logprobs is not None for s in sts)
    return SamplingInputs(md, batch.row_slots, valid, np.bool_(any_lp),
                          np.int32(step % (1 << 31)))


def sample(logits: jax.Array, inputs: SamplingInputs, state: Any, base_key: jax.Array, *,
           num_logprobs: int, plan: StepPlan = BRANCHED_PLAN) -> tuple[SamplerOutput, Any]:
    key = jax.random.fold_in(base_key, inputs.step)
    out = _sample(logits, inputs.md, state, inputs.slots, key, num_logprobs=None,
                  plan=plan.sampler)
    R = logits.shape[0]
    n = num_logprobs

    def with_lp():
        return compute_logprobs(logits.astype(jnp.float32), out.token_ids, n)

    def without_lp():
        return (jnp.zeros((R, n + 1), jnp.float32), jnp.zeros((R, n + 1), jnp.int32),
                jnp.zeros((R,), jnp.int32))
    if plan.sampler.branch:
        lp, lp_ids, rank = jax.lax.cond(inputs.any_logprobs, with_lp, without_lp)
    else:
        lp, lp_ids, rank = with_lp() if plan.logprobs else without_lp()
    state = penalties.record_tokens(state, inputs.slots, out.token_ids, inputs.valid)
    return SamplerOutput(out.token_ids, lp, lp_ids, rank), state


def row_logprobs(out: SamplerOutput, row: int, k: int) -> list[dict]:
    """Host: the logprobs entry of one sampled token (sampled + top k)."""
    return [logprob_dict(out.logprobs[row], out.logprob_token_ids[row],
                         int(out.sampled_rank[row]), k)]
