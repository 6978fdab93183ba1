"""The automaton's part of the jitted step: the rows' allowed-token words, the advance.

    slot states ──> allowed words [R, W] ──& host words (the host path's rows, if any)
        ──> SamplingInputs.token_mask ──> sampling/bitmask.apply_token_bitmask in the
        sampler (raw logits stay for logprobs) ──> token ──> advance(slot states)

Rows without a device constraint get all-ones words, so the host path's mask (or no
mask) passes unchanged; the sampler skips the bitmask when every word is all ones
(lax.cond on CPU/TPU; branch-free on GPU, where a cond is a host round trip).
"""
from __future__ import annotations

from typing import Any

import jax

from jaxserve.structured import device_pool
from jaxserve.structured.device_pool import AutomatonPool


def row_words(pool: AutomatonPool | None, slots: jax.Array,
              host_words: jax.Array | None) -> jax.Array | None:
    """[R, W] int32 token mask of the step's rows: each device-constrained row's state's
    allowed tokens, ANDed with the host path's words where given."""
    if pool is None:
        return host_words
    words = device_pool.mask_words(pool, device_pool.row_states(pool, slots))
    return words if host_words is None else words & host_words


def advance(pool: AutomatonPool | None, slots: jax.Array, tokens: jax.Array,
            valid: jax.Array) -> AutomatonPool | None:
    return None if pool is None else device_pool.advance(pool, slots, tokens, valid)


def pool_of(state: Any) -> AutomatonPool | None:
    return getattr(state, "automaton", None)
