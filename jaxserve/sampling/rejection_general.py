"""Exact rejection sampling for a draft with a real distribution q (draft model, self).

Glossary: R request rows, K proposals per row (num_speculative_tokens), V vocab.
rejection.py verifies deterministic (n-gram) proposals by comparing draws; a drafter
that samples d_j from a distribution q_j needs the general test, here, as one pure,
jittable, fixed-shape function of arrays, in two layouts of one rule:

    verify_rows(p [G, V], q [G, V], proposal [G], first [G], keys [G, 2], greedy [G],
                valid [G]) -> RowsOutput(tokens [G], emitted [G])
        the engine step's flat logit rows (sampling/in_step.py: device drafters)
    rejection_sample(p [R, K+1, V], q [R, K, V], d [R, K], n [R], keys [R, 2], greedy [R])
        -> RejectionOutput(tokens [R, K+1], num_accepted [R])
        one request row per row: verify_rows on its rows laid out flat

    position j     0          1               ...  n-1              n (n <= K)
    proposal       d_1        d_2                  d_n              -
    target         p_0        p_1(.|d_1)           p_{n-1}(.|..)    p_n(.|d_1..d_n)
    draft          q_0        q_1(.|d_1)           q_{n-1}(.|..)    -

The rule, per row (Leviathan et al. 2023; Chen et al. 2023):
  * walk j = 0, 1, ...: accept d_{j+1} when u_j * q_j(d) < p_j(d) (u_j uniform in
    [0, 1)), i.e. with probability min(1, p_j(d) / q_j(d));
  * at the first rejection j = a, emit a token from normalize(max(0, p_a - q_a));
  * if all n valid proposals are accepted (a = n), emit a bonus token from p_n.
  tokens = d_1 .. d_a, then that token, then -1; num_accepted = a (a + 1 emitted).

Why the emitted tokens are distributed exactly as plain sampling from p. One position,
d ~ q: P(d = x and accepted) = q(x) min(1, p(x)/q(x)) = min(p(x), q(x)). Rejection has
probability beta = 1 - sum_x min(p, q) = sum_x max(0, p - q), and then x is drawn with
probability max(0, p(x) - q(x)) / beta, so P(x emitted) = min(p, q) + max(0, p - q) = p(x).
Along the row: conditioned on the tokens emitted so far being accepted proposals
d_1..d_j, the next proposal d_{j+1} was drawn from q_j(.|d_1..d_j) with randomness
independent of the earlier acceptance tests, and p_j is the target's distribution given
the same prefix, so position j is again the one-position case. After a rejection the
row stops (the next step continues from the emitted token); after n acceptances the
bonus is drawn from p_n given exactly the accepted prefix. By induction every emitted
token is drawn from p given all tokens before it: the sequence distribution is that of
non-speculative sampling. Ragged rows: positions j >= n are never read as proposals.

Edge cases:
  * beta == 0 means p <= q everywhere, hence p == q (both sum to 1), and a rejection
    has probability 0; rounding (or a proposal with q(d) = p(d) = 0, which a drafter
    that samples from q never makes) can still reach it. The token is then drawn from
    p, which keeps it a token the target allows.
  * q(d) = 0 < p(d) accepts (the test reads 0 < p(d)); p(d) = 0 always rejects.
  * greedy rows (temperature 0): p is one-hot at the argmax, where the rule reduces to
    accept iff d_{j+1} == argmax p_j and emit argmax p_a. That is computed directly on
    integers, so no rounding can make speculative greedy differ from plain greedy.

Sampling controls: p and q must be what the sampler would draw from, after logit bias,
min_tokens, penalties (counting the proposals before each position as outputs:
SamplingMetadata.prev_draft_ids), temperature and top-k / top-p / min-p:
`sampling_probs` computes that with the sampler's own passes (sampler.apply_bias,
penalties.apply_penalties, truncation.truncate). Apply the structured-output bitmask
to the logits first (bitmask.apply_token_bitmask), as the sampler does.

Randomness (the contract the drafter must keep): every row has a key ([2] uint32,
`row_keys`): from (seed, output position of the row's first token) for seeded
requests, so a seeded request repeats itself whatever it is batched with and after
preemption; from (base_key, row) otherwise. One Threefry hash per number: u_j from
counter (j, 0), the final draw from (0, 1). The proposals must be drawn with randomness
independent of those two streams: `draft_uniforms(keys, K)` (counter (j, 2)) is such a
stream for the drafter. What a seeded request emits is then a function of its seed and
its steps (where each step starts, how many proposals it verifies): it repeats itself
whenever those repeat, but unlike the one-hot rule (rejection.py) it is not the token
sequence plain decoding draws (same distribution, other draws), and a schedule change
(a budget that caps k, a prefix-cache hit that moves where a prompt's chunks end)
gives other draws.

Cost: p and q are read, not copied: the acceptance test gathers one scalar of each
per logit row, greedy rows take one argmax pass over p, and every row gets one
two-level inverse-CDF draw over its residual (or p) -- a pass over [G, V] like the
sampler's own draw (rows whose draw is not emitted compute it too: fixed shapes).
In the engine G is the step's logit rows (at most max_num_seqs): at 64 rows and
V = 49152 in float32, p and q are 12.6 MB each. rejection_sample pads q to K + 1
positions (a copy) to lay the rows out flat. `sampling_probs` gives p flattened,
[R * (K+1), V]: reshape it (free).
"""
from __future__ import annotations

from flax import struct
import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from jaxserve.sampling.metadata import SamplingMetadata
from jaxserve.sampling.penalties import PenaltyState, apply_penalties
from jaxserve.sampling.sampler import (BLOCK, BRANCHED, SamplerPlan, apply_bias, argmax_last,
                                       pick_by_weight)
from jaxserve.sampling.truncation import Cut, cumsum_rows, no_cut, truncate

# counter word 2 of each random stream (word 1: the position)
_ACCEPT, _FINAL, _DRAFT, _SEEDED_ROW, _UNSEEDED_ROW = 0, 1, 2, 3, 4


@struct.dataclass
class RejectionOutput:
    tokens: jax.Array        # [R, K+1] int32 emitted tokens, left-aligned, then -1
    num_accepted: jax.Array  # [R] int32 accepted proposals a (0..n); a + 1 tokens emitted


@struct.dataclass
class RowsOutput:
    tokens: jax.Array        # [G] int32 each logit row's emitted token, -1 if not emitted
    emitted: jax.Array       # [G] bool (per request row: a prefix of its logit rows)


def rejection_sample(target_probs: jax.Array, draft_probs: jax.Array,
                     draft_tokens: jax.Array, num_valid: jax.Array, keys: jax.Array,
                     greedy: jax.Array) -> RejectionOutput:
    """Verify the rows' proposals (see the module docstring for the rule and its proof):
    verify_rows on the rows laid out flat, position j of row r at logit row r(K+1) + j.

    target_probs  [R, K+1, V] f32  p_j, rows summing to 1 (one-hot for greedy rows)
    draft_probs   [R, K, V]   f32  q_j, the distribution d_{j+1} was drawn from
    draft_tokens  [R, K]      int32 d_1..d_K (entries at j >= num_valid are ignored)
    num_valid     [R]         int32 n in [0, K]: proposals to verify (0: plain sample)
    keys          [R, 2]      uint32 per-row keys (row_keys)
    greedy        [R]         bool   temperature-0 rows: argmax matching
    """
    R, K1, V = target_probs.shape
    K = K1 - 1
    assert K >= 1 and draft_probs.shape == (R, K, V) and draft_tokens.shape == (R, K)
    j = jnp.arange(K1)[None, :]
    d = jnp.concatenate([draft_tokens, jnp.zeros((R, 1), draft_tokens.dtype)], axis=1)
    proposal = jnp.where(j < num_valid[:, None], d, -1)
    q = jnp.concatenate([draft_probs, jnp.zeros((R, 1, V), draft_probs.dtype)], axis=1)
    out = verify_rows(target_probs.reshape(R * K1, V), q.reshape(R * K1, V),
                      proposal.reshape(-1), jnp.repeat(jnp.arange(R) * K1, K1),
                      jnp.repeat(keys, K1, axis=0), jnp.repeat(greedy, K1),
                      (j <= num_valid[:, None]).reshape(-1))
    emitted = out.emitted.reshape(R, K1)
    return RejectionOutput(out.tokens.reshape(R, K1),
                           (jnp.sum(emitted, axis=1) - 1).astype(jnp.int32))


def verify_rows(target_probs: jax.Array, draft_probs: jax.Array, proposal: jax.Array,
                first: jax.Array, keys: jax.Array, greedy: jax.Array,
                valid: jax.Array) -> RowsOutput:
    """The rule on flat logit rows, the engine step's layout: request row r owns the
    consecutive logit rows first_r .. first_r + n_r (position j = g - first_r), the last
    one with no proposal (its draw is the bonus).

    target_probs  [G, V] f32   p of each logit row
    draft_probs   [G, V] f32   q of each row's proposal (read only where proposal >= 0)
    proposal      [G] int32    the proposal d_{j+1} checked at this row; -1: none
    first         [G] int32    first logit row of the row's request row
    keys          [G, 2] uint32 its request row's key (row_keys), on every logit row
    greedy        [G] bool     argmax matching
    valid         [G] bool     rows that verify (others are neither emitted nor read)
    """
    G, V = target_probs.shape
    g = jnp.arange(G)
    has = valid & (proposal >= 0)
    d = jnp.clip(proposal, 0, V - 1)
    p_d, q_d = target_probs[g, d], draft_probs[g, d]
    best = argmax_last(target_probs)                                         # [G]
    u = _uniforms(keys, g - first, _ACCEPT)
    ok = jnp.where(greedy, d == best, u * q_d < p_d)
    rejected = (has & ~ok).astype(jnp.int32)
    before = jnp.cumsum(rejected) - rejected          # rejections earlier in the array
    emitted = valid & (before == before[first])       # none earlier in its request row
    # emitted and not an accepted proposal: the first rejection (residual) or the bonus
    resid = jnp.where(has[:, None], jnp.maximum(target_probs - draft_probs, 0.0),
                      target_probs)
    w = jnp.where(jnp.sum(resid, axis=1, keepdims=True) > 0, resid, target_probs)
    final = draw(w, _uniforms(keys, jnp.zeros((G,), jnp.int32), _FINAL))
    tokens = jnp.where(has & ok, d, jnp.where(greedy, best, final))
    return RowsOutput(jnp.where(emitted, tokens, -1).astype(jnp.int32), emitted)


def draw(weights: jax.Array, u: jax.Array) -> jax.Array:
    """[R] int32: per row, token i with probability weights[i] / sum(weights) (weights
    [R, V] >= 0, some > 0), by inverse CDF with the row's uniform u [R]: a block of
    BLOCK tokens by its mass, then a token inside it (the sampler's two-level draw)."""
    R, V = weights.shape
    pad = -V % BLOCK
    w = jnp.pad(weights, ((0, 0), (0, pad))) if pad else weights
    w = w.reshape(R, -1, BLOCK)
    block_w = jnp.sum(w, axis=2)                                             # [R, V/BLOCK]
    t = u * jnp.sum(block_w, axis=1)
    b = pick_by_weight(block_w, t)
    t_in = t - (cumsum_rows(block_w) - block_w)[jnp.arange(R), b]
    return b * BLOCK + pick_by_weight(w[jnp.arange(R), b], t_in)


def row_keys(seed: jax.Array, has_seed: jax.Array, output_pos: jax.Array,
             base_key: jax.Array) -> jax.Array:
    """[R, 2] uint32 keys of a step's request rows. seed [R, 2], has_seed [R] and
    output_pos [R] (of the row's first verified position) as in SamplingMetadata;
    base_key: the step's key (threefry, raw uint32[2] or typed), used by unseeded rows."""
    if jnp.issubdtype(base_key.dtype, jax.dtypes.prng_key):
        base_key = jax.random.key_data(base_key)
    base_key = base_key.astype(jnp.uint32)
    R = has_seed.shape[0]
    k1 = jnp.where(has_seed, seed[:, 0], base_key[0]).astype(jnp.uint32)
    k2 = jnp.where(has_seed, seed[:, 1], base_key[1]).astype(jnp.uint32)
    c1 = jnp.where(has_seed, output_pos, jnp.arange(R)).astype(jnp.uint32)
    c2 = jnp.where(has_seed, _SEEDED_ROW, _UNSEEDED_ROW).astype(jnp.uint32)
    w1, w2 = threefry2x32_p.bind(k1, k2, c1, c2)
    return jnp.stack([w1, w2], axis=1)


def draft_uniforms(keys: jax.Array, k: int) -> jax.Array:
    """[R, k] f32 in [0, 1): uniforms for drawing d_1..d_k from q, independent of the
    streams rejection_sample reads (a drafter may use any other independent source)."""
    R = keys.shape[0]
    return _uniforms(keys, jnp.broadcast_to(jnp.arange(k), (R, k)), _DRAFT)


def _uniforms(keys: jax.Array, pos: jax.Array, stream: int) -> jax.Array:
    """pos-shaped f32 uniforms in [0, 1) (24 bits): Threefry of counter (pos, stream)
    under each row's key (keys [R, 2]; pos [R] or [R, n])."""
    shape = pos.shape
    k = keys.astype(jnp.uint32).reshape((keys.shape[0],) + (1,) * (len(shape) - 1) + (2,))
    k1 = jnp.broadcast_to(k[..., 0], shape)
    k2 = jnp.broadcast_to(k[..., 1], shape)
    bits, _ = threefry2x32_p.bind(k1, k2, pos.astype(jnp.uint32),
                                  jnp.full(shape, stream, jnp.uint32))
    return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def sampling_probs(logits: jax.Array, md: SamplingMetadata, penalty_state: PenaltyState,
                   slots: jax.Array, *, plan: SamplerPlan = BRANCHED) -> jax.Array:
    """[N, V] f32: the distribution sampler.sample draws each row's token from (N logit
    rows, each with its own settings in md): bias and min_tokens, penalties, temperature,
    top-k / top-p / min-p; one-hot at the argmax for greedy rows. plan (static): how
    optional work is skipped, as in the sampler (branch-free on GPU)."""
    processed = apply_penalties(apply_bias(logits.astype(jnp.float32), md), penalty_state,
                                slots, md, branch=plan.branch)
    onehot = jax.nn.one_hot(argmax_last(processed), processed.shape[1],
                            dtype=jnp.float32)
    if not plan.sample:
        return onehot

    def mixed() -> jax.Array:
        is_random = md.temperature > 0
        return jnp.where(is_random[:, None], _tempered(processed, md, is_random, plan), onehot)
    if plan.branch:
        return jax.lax.cond(md.all_greedy, lambda: onehot, mixed)
    return mixed()


def _tempered(processed: jax.Array, md: SamplingMetadata, is_random: jax.Array,
              plan: SamplerPlan) -> jax.Array:
    """Sampling rows: softmax of the tempered logits over the kept set {x >= threshold},
    the set and weights the sampler's inverse-CDF draw uses."""
    N, V = processed.shape
    x = processed / jnp.where(is_random, md.temperature, 1.0)[:, None]
    if plan.branch:
        cut: Cut = jax.lax.cond(md.any_truncation, lambda: truncate(x, md, is_random),
                                lambda: no_cut(N, V))
    else:
        cut = truncate(x, md, is_random, branch=False, exact=plan.exact)
    m = jnp.max(x, axis=1, keepdims=True)
    w = jnp.where(x >= cut.threshold[:, None], jnp.exp(x - m), 0.0)
    return w / jnp.sum(w, axis=1, keepdims=True)
