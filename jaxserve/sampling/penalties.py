"""Repetition / presence / frequency penalties over token counts kept on the device.

Glossary: S persistent request slots (max_num_seqs + 1 padding slot), R rows, V vocab,
L padded prompt (or output) length.

The runner gives each running request a slot for its lifetime, calls `set_prompt` when
the request is admitted (and `set_outputs` when a preempted request comes back with
output tokens already), and `record_tokens` with each step's sampled tokens. All are
pure and jittable; donate the state where it is updated.

Semantics (vLLM v1 / transformers / OpenAI):
  repetition (HF RepetitionPenaltyLogitsProcessor), over prompt + output tokens:
      logit > 0 -> logit / rp,  logit <= 0 -> logit * rp
  frequency and presence (OpenAI), over output tokens only:
      logit -= frequency * count + presence * (count > 0)
"""
from __future__ import annotations

import dataclasses

from flax import struct
import jax
import jax.numpy as jnp

from jaxserve.sampling.metadata import SamplingMetadata


@struct.dataclass
class PenaltyState:
    output_counts: jax.Array   # [S, V] int32 times each token was sampled by the slot's request
    prompt_mask: jax.Array     # [S, V] bool token occurs in the slot's prompt


def init_penalty_state(num_slots: int, vocab: int) -> PenaltyState:
    return PenaltyState(jnp.zeros((num_slots, vocab), jnp.int32),
                        jnp.zeros((num_slots, vocab), bool))


def _token_row(ids: jax.Array, n: jax.Array, vocab: int, dtype) -> jax.Array:
    """[V] histogram of ids[:n] (ids [L])."""
    valid = jnp.arange(ids.shape[0]) < n
    return jnp.zeros((vocab,), dtype).at[jnp.where(valid, ids, vocab)].add(
        jnp.ones(ids.shape, dtype), mode="drop")


def set_prompt(state: PenaltyState, slot: jax.Array, prompt_ids: jax.Array,
               prompt_len: jax.Array) -> PenaltyState:
    """Start a request in `slot`: its prompt is prompt_ids[:prompt_len] (prompt_ids [L],
    padded to a static bucket); its output counts are zeroed."""
    V = state.prompt_mask.shape[1]
    mask = _token_row(prompt_ids, prompt_len, V, jnp.int32) > 0
    return PenaltyState(state.output_counts.at[slot].set(0),
                        state.prompt_mask.at[slot].set(mask))


def set_outputs(state: PenaltyState, slot: jax.Array, output_ids: jax.Array,
                output_len: jax.Array) -> PenaltyState:
    """Set the slot's output counts to those of output_ids[:output_len] ([L], padded):
    for a request resumed after preemption (call after set_prompt)."""
    V = state.output_counts.shape[1]
    counts = _token_row(output_ids, output_len, V, jnp.int32)
    return dataclasses.replace(state, output_counts=state.output_counts.at[slot].set(counts))


def record_tokens(state: PenaltyState, slots: jax.Array, tokens: jax.Array,
                  valid: jax.Array) -> PenaltyState:
    """Count tokens [R] sampled for slots [R]; rows with valid [R] False are ignored."""
    counts = state.output_counts.at[slots, tokens].add(valid.astype(jnp.int32))
    return dataclasses.replace(state, output_counts=counts)


def apply_penalties(logits: jax.Array, state: PenaltyState, slots: jax.Array,
                    md: SamplingMetadata, *, branch: bool = True) -> jax.Array:
    """logits [R, V] f32 -> penalised logits. Neutral penalties are the identity; with
    branch (static) the pass is skipped under lax.cond when no row has one, without it
    (GPU: no conditionals, see sampler.py) it always runs."""
    def penalise(logits):
        counts = state.output_counts[slots]                  # [R, V]
        if md.prev_draft_ids is not None:   # proposals verified before this position
            rows = jnp.arange(counts.shape[0])[:, None]
            counts = counts.at[rows, md.prev_draft_ids].add(1, mode="drop")
        seen = state.prompt_mask[slots] | (counts > 0)
        rp = jnp.where(seen, md.repetition_penalty[:, None], 1.0)
        logits = jnp.where(logits > 0, logits / rp, logits * rp)
        return (logits - md.frequency_penalty[:, None] * counts
                - md.presence_penalty[:, None] * (counts > 0))

    if not branch:
        return penalise(logits)
    return jax.lax.cond(md.any_penalty, penalise, lambda x: x, logits)
