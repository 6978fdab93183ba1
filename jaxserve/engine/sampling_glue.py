"""The runner's side of the sampler: per-step inputs and the in-step sampling call.

The sampler state (penalty counts) lives on the device in persistent request slots;
the runner sets a slot's prompt when a request (re)starts there, and the jitted step
records every sampled token. Logprobs are computed under a cond, so steps whose
requests asked for none skip the top-k over the vocabulary without a second compile.
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
from jaxserve.sampling.sampler import SamplerOutput
from jaxserve.sampling.sampler import sample as _sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    md: SamplingMetadata
    slots: jax.Array          # [R] int32 persistent slot of each row
    valid: jax.Array          # [R] bool row samples a real token this step
    any_logprobs: jax.Array   # [] bool some row asked for logprobs


def init_state(num_slots: int, vocab: int) -> penalties.PenaltyState:
    return penalties.init_penalty_state(num_slots, vocab)


@partial(jax.jit, donate_argnums=(0,))
def _start_slot(state, slot, ids, num_prompt, num_total):
    state = penalties.set_prompt(state, slot, ids, num_prompt)
    out_ids = jnp.roll(ids, -num_prompt)      # outputs so far (a request resumed after preemption)
    return penalties.set_outputs(state, slot, out_ids, num_total - num_prompt)


def set_prompt(state: Any, slot: int, token_ids: list[int], num_prompt: int,
               pad_to: int) -> Any:
    """(Re)start `slot` with a request's prompt (and outputs so far). ids are padded
    to one static length so this never recompiles."""
    ids = np.zeros(pad_to, np.int32)
    ids[:len(token_ids)] = token_ids
    return _start_slot(state, np.int32(slot), ids, np.int32(num_prompt), np.int32(len(token_ids)))


def build_inputs(batch: Any, states: Mapping[str, Any], vocab: int) -> SamplingInputs:
    R = batch.row_slots.shape[0]
    sts = [states[r] for r in batch.row_req_ids]
    md = build_sampling_metadata([s.sampling_params for s in sts], [s.output_len for s in sts],
                                 [s.eos_token_ids for s in sts], R, vocab)
    valid = np.zeros(R, bool)
    valid[:len(sts)] = batch.row_samples
    any_lp = any(s.sampling_params.logprobs is not None for s in sts)
    return SamplingInputs(md, batch.row_slots, valid, np.bool_(any_lp))


def sample(logits: jax.Array, inputs: SamplingInputs, state: Any, key: jax.Array, *,
           num_logprobs: int) -> tuple[SamplerOutput, Any]:
    out = _sample(logits, inputs.md, state, inputs.slots, key, num_logprobs=None)
    R = logits.shape[0]
    n = num_logprobs

    def with_lp():
        return compute_logprobs(logits, out.token_ids, n)

    def without_lp():
        return (jnp.zeros((R, n + 1), jnp.float32), jnp.zeros((R, n + 1), jnp.int32),
                jnp.zeros((R,), jnp.int32))
    lp, lp_ids, rank = jax.lax.cond(inputs.any_logprobs, with_lp, without_lp)
    state = penalties.record_tokens(state, inputs.slots, out.token_ids, inputs.valid)
    return SamplerOutput(out.token_ids, lp, lp_ids, rank), state


def row_logprobs(out: SamplerOutput, row: int, k: int) -> list[dict]:
    """Host: the logprobs entry of one sampled token (sampled + top k)."""
    return [logprob_dict(out.logprobs[row], out.logprob_token_ids[row],
                         int(out.sampled_rank[row]), k)]
