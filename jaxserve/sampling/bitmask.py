"""The per-row token bitmask of structured outputs, applied inside the jitted sampler.

    mask_words [R, W] int32, W = ceil(V / 32): bit j of word w allows token 32w + j
    (llguidance's and xgrammar's layout). A row of all ones (-1) is unconstrained.

The host fills constrained rows from the grammar matchers (jaxserve/structured/); an
on-device automaton can fill them inside the step instead; either way the rows reach
`apply_token_bitmask`, the one place the mask meets the logits (before bias, penalties,
temperature and truncation, so greedy and sampled rows alike only see allowed tokens).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ALL_ALLOWED = -1        # an int32 word with every bit set


def apply_token_bitmask(logits: jax.Array, mask_words: jax.Array) -> jax.Array:
    """logits [R, V] -> logits with -inf where the row's bit is 0. mask_words [R, W]
    int32; tokens past 32W (a vocabulary wider than the mask) are disallowed."""
    R, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (mask_words[:, :, None] >> shifts) & 1           # [R, W, 32] (arithmetic >>)
    allowed = bits.reshape(R, -1).astype(jnp.bool_)
    width = allowed.shape[1]
    if width >= V:
        allowed = allowed[:, :V]
    else:
        allowed = jnp.pad(allowed, ((0, 0), (0, V - width)))
    return jnp.where(allowed, logits, -jnp.inf)


def mask_logits(logits: jax.Array, mask_words: jax.Array | None, *,
                branch: bool = True) -> jax.Array:
    """apply_token_bitmask where some row is constrained. branch (static): skip it with a
    lax.cond when every word is all ones (CPU, TPU); branch-free (GPU: a cond is a host
    round trip there) it always runs, the identity for unconstrained rows.

    The sampler then runs once, on what this returns. The other form, the sampler in
    both branches of the cond (raw logits in one, masked in the other), spares an
    unconstrained step the cond's copy of the [R, V] logits, but puts the sampler in the
    step program twice, and the sampler is most of a small step's compile: measured in
    docs/benchmarks.md ("Sampler and output processing")."""
    if mask_words is None:
        return logits
    if not branch:
        return apply_token_bitmask(logits, mask_words)
    any_masked = jnp.any(mask_words != ALL_ALLOWED)
    return jax.lax.cond(any_masked, apply_token_bitmask, lambda x, _: x, logits, mask_words)
