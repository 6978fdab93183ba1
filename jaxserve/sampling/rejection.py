"""Verification of proposed tokens inside the jitted step: exact rejection sampling.

A speculating request row holds its last token t0 and k proposals d1..dk; the step
computes the target's logits at all k+1 positions and the sampler draws one token x_j
per position ("logit rows", one sampling row each, with every sampling control applied
to p_j: temperature, top-k/p, min-p, penalties counting d1..dj as outputs, logit bias,
min_tokens at output position + j):

    logit row   j=0        j=1          ...  j=k
    input       t0         d1                dk
    draws       x0 ~ p0    x1 ~ p1(.|d1)     xk ~ pk(.|d1..dk)
    accept      x0 == d1   x1 == d2          (bonus)

Row emits x0..xa, a = the first j with x_j != d_{j+1} (or k: all accepted + bonus).

Why this is rejection sampling (Leviathan et al. / Chen et al.) exactly: proposals
from n-gram lookup are deterministic, q_j = one-hot(d_{j+1}). Then
  * P(accept d) = P(x_j == d) = p_j(d) = min(1, p_j(d) / q_j(d));
  * on rejection x_j is p_j conditioned on x_j != d, i.e. p_j(x) / (1 - p_j(d)) for
    x != d, which is normalize(max(0, p_j - q_j));
  * after k acceptances x_k ~ p_k is the bonus token.
Greedy rows are the temperature-0 case: x_j = argmax p_j (argmax matching).
Each draw uses the sampler's own uniform for that output position (seeded rows hash
(seed, output position)), so a seeded request emits exactly the tokens it would
without speculation, whatever it is batched with.

Device drafters (self, draft_model) draw their proposals for sampled rows from a
distribution q instead: those rows are verified by the general rule
(rejection_general.verify_rows, called from sampling/in_step.py); greedy rows and
n-gram proposals stay here.

Host inputs per logit row g (SpecInputs): next_draft[g] = d_{j+1} (-1 on a row's last
logit row and on rows that do not speculate) and row_first[g] = the first logit row of
its request row. All shapes are the sampler's [R]: no new compiled shapes.
"""
from __future__ import annotations

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np


@struct.dataclass
class SpecInputs:
    next_draft: jax.Array     # [R] int32 proposal this logit row's draw is checked against
    row_first: jax.Array      # [R] int32 first logit row of the same request row


def empty_spec_inputs(num_rows: int) -> SpecInputs:
    """Host: no logit row speculates (every row is its own first row)."""
    return SpecInputs(np.full(num_rows, -1, np.int32), np.arange(num_rows, dtype=np.int32))


def emitted_mask(token_ids: jax.Array, valid: jax.Array, spec: SpecInputs) -> jax.Array:
    """[R] bool: logit rows whose draw is emitted (valid rows whose earlier logit rows
    in the same request row all matched their proposal)."""
    mismatch = valid & (token_ids != spec.next_draft)
    before = jnp.cumsum(mismatch.astype(jnp.int32)) - mismatch      # exclusive cumsum
    return valid & (before == before[spec.row_first])


def last_emitted(token_ids: jax.Array, spec: SpecInputs) -> jax.Array:
    """[R] bool, for token_ids already masked to -1 where not emitted: the last emitted
    logit row of each request row (one per row: its slot's latest token). A row's
    emitted logit rows are a prefix of its own, so it is the one whose successor is
    not emitted or belongs to another request row."""
    emitted = token_ids >= 0
    no = jnp.zeros((1,), bool)
    next_emitted = jnp.concatenate([emitted[1:], no])
    next_same_row = jnp.concatenate([spec.row_first[1:] == spec.row_first[:-1], no])
    return emitted & ~(next_emitted & next_same_row)
