"""Adapter between the runner and the sampler (temporary: greedy + temperature).

Replaced by jaxserve/sampling once the batched sampler lands; the runner only calls
init_state, set_prompt, build_metadata, sample and row_logprobs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Meta:
    temperature: jax.Array   # [R]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Out:
    token_ids: jax.Array     # [R]


def init_state(num_slots: int, vocab: int) -> Any:
    return jnp.zeros((num_slots,), jnp.int32)


def set_prompt(state: Any, slot: int, token_ids: list[int], num_prompt: int) -> Any:
    return state


def build_metadata(batch: Any, states: Mapping[str, Any], pad_slot: int, vocab: int) -> _Meta:
    R = batch.row_slots.shape[0]
    temp = np.zeros(R, np.float32)
    for r, rid in enumerate(batch.row_req_ids):
        temp[r] = states[rid].sampling_params.temperature
    return _Meta(jnp.asarray(temp))


def sample(logits: jax.Array, md: _Meta, state: Any, key: jax.Array, *, num_logprobs: int):
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    t = jnp.where(md.temperature > 0, md.temperature, 1.0)
    drawn = jax.random.categorical(key, logits / t[:, None], axis=-1).astype(jnp.int32)
    return _Out(jnp.where(md.temperature > 0, drawn, greedy)), state


def row_logprobs(out: Any, row: int, k: int) -> Any:
    return None
