"""The batched sampler: one jittable function, rows with different settings in one batch.

Glossary: R rows (padded), V vocab, C candidates (see truncation.py), n = num_logprobs.

    logits [R, V] (raw) ──> logprobs (raw, see logprobs.py)
       │ (all rows greedy, no bias/penalty: just argmax; nothing below runs)
       │ logit_bias, then stop ids -> -inf while output_pos < min_tokens
       │ penalties (repetition, frequency, presence; penalties.py)
       ├──> argmax ─────────────────────────────> greedy rows (temperature 0)
       │ / temperature; threshold = top_k ∧ top_p ∧ min_p (truncation.py)
       └──> inverse-CDF draw with one uniform u per row ─> sampled rows
              from the C candidates when the kept set lies inside them,
              else from the whole vocabulary (two-level: blocks, then within a block)

Randomness: one uniform per row and step, a Threefry hash (see row_uniforms) of
(seed, output_pos) for seeded rows, so a seeded request draws the same tokens whatever
it is batched with and after preemption, and of (base_key, row) for the others, with
base_key advanced every step by the caller (the engine: fold_in(base, step), inside the
jitted step). Whether a row draws from the candidates or the vocabulary depends on that
row alone, and skipping (below) only skips work no row needs, so a row's token never
depends on the rest of the batch.

Skipping work no row needs, two ways (SamplerPlan, static):
  branch=True   lax.cond on the step's flags: one program for every mix of settings.
                For CPU and TPU, which evaluate the predicate on the device.
  branch=False  no data-dependent conditional at all. XLA:GPU runs a conditional by
                copying its predicate to the host and blocking on the stream
                (ConditionalThunk::ExecuteOnStream: Memcpy + BlockHostUntilDone), so each
                cond is a host round trip that drains the launch queue. Cheap optional
                work (bias, penalties, the vocabulary draw) then always runs (it is the
                identity for rows that do not use it); the expensive parts (the random
                path with its top-k, the exact threshold search) are in the program only
                when the host-side flags of the step say some row needs them.
"""
from __future__ import annotations

import dataclasses

from flax import struct
import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from jaxserve.sampling.logprobs import compute_logprobs
from jaxserve.sampling.metadata import SamplingMetadata
from jaxserve.sampling.penalties import PenaltyState, apply_penalties
from jaxserve.sampling.truncation import Cut, cumsum_rows, no_cut, truncate

BLOCK = 256   # vocabulary block of the two-level inverse-CDF draw


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerPlan:
    """What the compiled sampler contains (static; see the module docstring)."""
    branch: bool = True    # skip optional work with lax.cond (False: no conditionals)
    sample: bool = True    # the random path (some row has temperature > 0)
    exact: bool = True     # the exact threshold search (some row may need it)

    @staticmethod
    def for_step(md: SamplingMetadata) -> "SamplerPlan":
        """Host: the branch-free plan for a step with these (numpy) settings."""
        sampling = not bool(md.all_greedy)
        return SamplerPlan(False, sample=sampling, exact=sampling and bool(md.any_exact))


BRANCHED = SamplerPlan()


@struct.dataclass
class SamplerOutput:
    token_ids: jax.Array                 # [R] int32
    logprobs: jax.Array | None           # [R, n+1] f32 sampled token first, then top n
    logprob_token_ids: jax.Array | None  # [R, n+1] int32
    sampled_rank: jax.Array | None       # [R] int32 1-based rank of the sampled token


def sample(logits: jax.Array, md: SamplingMetadata, penalty_state: PenaltyState,
           slots: jax.Array, base_key: jax.Array, *, num_logprobs: int | None = None,
           plan: SamplerPlan = BRANCHED) -> SamplerOutput:
    """Sample one token per row. logits [R, V]; slots [R] the rows' PenaltyState slots;
    base_key a threefry key (uint32[2] or typed). num_logprobs (static): None computes
    no logprobs; n >= 0 returns the sampled token's logprob and the top n. plan (static):
    how work no row needs is skipped."""
    logits = logits.astype(jnp.float32)
    if plan.branch:
        plain_greedy = md.all_greedy & ~md.any_penalty & ~md.any_bias
        tokens = jax.lax.cond(plain_greedy, lambda: _argmax(logits),
                              lambda: _sample_processed(logits, md, penalty_state, slots,
                                                        base_key, plan))
    else:
        tokens = _sample_processed(logits, md, penalty_state, slots, base_key, plan)
    if num_logprobs is None:
        return SamplerOutput(tokens, None, None, None)
    lp, lp_ids, rank = compute_logprobs(logits, tokens, num_logprobs)
    return SamplerOutput(tokens, lp, lp_ids, rank)


def _sample_processed(logits, md, penalty_state, slots, base_key, plan):
    processed = apply_penalties(apply_bias(logits, md), penalty_state, slots, md,
                                branch=plan.branch)
    greedy = _argmax(processed)
    if not plan.sample:
        return greedy
    if not plan.branch:
        return _sample_random(processed, md, base_key, greedy, plan)
    return jax.lax.cond(md.all_greedy, lambda: greedy,
                        lambda: _sample_random(processed, md, base_key, greedy, plan))


def _argmax(x: jax.Array) -> jax.Array:
    return argmax_last(x)


def argmax_last(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) (int32, first index of the maximum), in two levels:
    the block of BLOCK entries holding the maximum, then the entry inside it. XLA:CPU's
    argmax over a wide last axis runs far slower than a max reduction
    (docs/benchmarks.md, "Measurements behind code choices")."""
    *lead, V = x.shape
    pad = -V % BLOCK
    if pad:
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf)
    x = x.reshape(*lead, -1, BLOCK)
    b = jnp.argmax(jnp.max(x, axis=-1), axis=-1)
    inner = jnp.take_along_axis(x, b[..., None, None], axis=-2)[..., 0, :]
    return (b * BLOCK + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def apply_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """logit_bias, then -inf on the stop ids of rows still under min_tokens. Two small
    scatters (padding entries are dropped); the branched plan skips them when md.any_bias
    is off (branch-free, they are the identity for rows without bias)."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    logits = logits.at[rows, md.bias_ids].add(md.bias_values, mode="drop")
    under = (md.output_pos < md.min_tokens)[:, None]
    return logits.at[rows, jnp.where(under, md.stop_ids, V)].set(-jnp.inf, mode="drop")


def row_uniforms(md: SamplingMetadata, base_key: jax.Array) -> jax.Array:
    """[R] f32 in [0, 1): the one random number each row gets this step.

    One Threefry-2x32 hash per row (the counter-based generator behind jax.random):
    seeded rows hash counter (output_pos, 0) under the key made of their seed's two
    words; other rows hash (row, 1) under base_key."""
    if jnp.issubdtype(base_key.dtype, jax.dtypes.prng_key):
        base_key = jax.random.key_data(base_key)
    base_key = base_key.astype(jnp.uint32)
    R = md.num_rows
    seeded = md.has_seed
    k1 = jnp.where(seeded, md.seed[:, 0], base_key[0])
    k2 = jnp.where(seeded, md.seed[:, 1], base_key[1])
    c1 = jnp.where(seeded, md.output_pos, jnp.arange(R)).astype(jnp.uint32)
    c2 = jnp.where(seeded, 0, 1).astype(jnp.uint32)
    bits, _ = threefry2x32_p.bind(k1, k2, c1, c2)
    return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def _sample_random(processed, md, base_key, greedy, plan):
    is_random = md.temperature > 0
    x = processed / jnp.where(is_random, md.temperature, 1.0)[:, None]
    R, V = x.shape
    u = row_uniforms(md, base_key)
    if plan.branch:
        cut: Cut = jax.lax.cond(md.any_truncation, lambda: truncate(x, md, is_random),
                                lambda: no_cut(R, V))
    else:
        cut = truncate(x, md, is_random, branch=False, exact=plan.exact)
    w = jnp.where(cut.cand_vals >= cut.threshold[:, None],
                  jnp.exp(cut.cand_vals - cut.cand_vals[:, :1]), 0.0)
    from_cands = _take(cut.cand_ids, pick_by_weight(w, u * jnp.sum(w, axis=1)))
    whole = is_random & ~cut.covered
    if plan.branch:
        from_vocab = jax.lax.cond(jnp.any(whole), lambda: _draw_vocab(x, cut.threshold, u),
                                  lambda: greedy)
    else:
        from_vocab = _draw_vocab(x, cut.threshold, u)
    return jnp.where(is_random, jnp.where(cut.covered, from_cands, from_vocab), greedy)


def _draw_vocab(x, threshold, u):
    """Inverse-CDF draw over the whole vocabulary of the kept tokens (x >= threshold):
    pick a block of BLOCK tokens by its mass, then a token inside it (one pass over V)."""
    R, V = x.shape
    pad = -V % BLOCK
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    m = jnp.max(x, axis=1, keepdims=True)
    w = jnp.where(x >= threshold[:, None], jnp.exp(x - m), 0.0).reshape(R, -1, BLOCK)
    block_w = jnp.sum(w, axis=2)                                    # [R, V/BLOCK]
    t = u * jnp.sum(block_w, axis=1)
    b = pick_by_weight(block_w, t)
    t_in = t - (cumsum_rows(block_w) - block_w)[jnp.arange(R), b]
    inner = w[jnp.arange(R), b]                                     # [R, BLOCK]
    return b * BLOCK + pick_by_weight(inner, t_in)


def pick_by_weight(w: jax.Array, t: jax.Array) -> jax.Array:
    """Per row, the least i with cumsum(w)[i] > t (w [R, n] >= 0, some > 0); rounding
    that would land on a zero-weight entry falls back to the last positive one."""
    i = jnp.sum(cumsum_rows(w) <= t[:, None], axis=1)
    last = w.shape[1] - 1 - jnp.argmax(w[:, ::-1] > 0, axis=1)
    i = jnp.minimum(i, last)
    return jnp.where(_take(w, i) > 0, i, last).astype(jnp.int32)


def _take(a: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(a, idx[:, None], axis=1)[:, 0]
