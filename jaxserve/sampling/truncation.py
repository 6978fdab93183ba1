"""top-k / top-p / min-p as one per-row logit threshold, without sorting the vocabulary.

Glossary: R rows, V vocab, C = min(TOPK_CAP + 1, V) candidates.

Semantics (transformers' warper order: top_k, then top_p over the top-k set
renormalised, then min_p; all three on temperature-scaled logits x):
  top_k: keep x >= the k-th largest x (ties at the boundary are all kept);
  top_p: keep token i iff the probability mass of tokens strictly more likely than i
         is < p (always keeps the most likely token; same as vLLM's ascending-cumsum
         `<= 1 - p` rule up to rounding, ties kept as a group);
  min_p: keep p_i >= min_p * p_max, i.e. x >= x_max + log(min_p).
Each is a threshold on x, so the kept set is {x >= max of the three thresholds}.

Fast path: lax.top_k(x, C) gives the sorted candidates; top-k for k <= TOPK_CAP and
top-p whose mass is reached inside the candidates are read off them. Otherwise
(k > TOPK_CAP, or a flat distribution whose top-p mass lies beyond the candidates) an
exact search runs, only when some row of the step needs it: a bisection over the
32-bit order-preserving integer image of the floats finds the exact threshold in 32
masked reductions (cheaper than a full sort on CPU by ~10x, and exact).

`covered` says the kept set lies inside the candidates, so the sampler can draw from
the C candidates instead of the whole vocabulary. Every decision here is per row, so a
row's result never depends on the other rows of the batch.
"""
from __future__ import annotations

from flax import struct
import jax
import jax.numpy as jnp

from jaxserve.sampling.metadata import TOPK_CAP, SamplingMetadata, num_candidates

__all__ = ["TOPK_CAP", "Cut", "num_candidates", "no_cut", "cumsum_rows", "truncate"]


@struct.dataclass
class Cut:
    threshold: jax.Array   # [R] f32 keep x >= threshold (-inf: keep all)
    covered: jax.Array     # [R] bool the kept set lies inside the candidates
    cand_vals: jax.Array   # [R, C] f32 the C largest x, descending
    cand_ids: jax.Array    # [R, C] int32 their token ids


def no_cut(num_rows: int, vocab: int) -> Cut:
    C = num_candidates(vocab)
    return Cut(jnp.full((num_rows,), -jnp.inf), jnp.zeros((num_rows,), bool),
               jnp.zeros((num_rows, C), jnp.float32), jnp.zeros((num_rows, C), jnp.int32))


def cumsum_rows(w: jax.Array) -> jax.Array:
    """Inclusive cumsum along axis 1 of a narrow [R, n] array, as a matmul with a
    triangular matrix: faster to compile and to run than jnp.cumsum at these widths."""
    n = w.shape[1]
    tri = (jnp.arange(n)[:, None] <= jnp.arange(n)[None, :]).astype(w.dtype)
    return jnp.matmul(w, tri, precision=jax.lax.Precision.HIGHEST)


def _take(a: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(a, idx[:, None], axis=1)[:, 0]


def truncate(x: jax.Array, md: SamplingMetadata, is_random: jax.Array, *,
             branch: bool = True, exact: bool = True) -> Cut:
    """x [R, V] temperature-scaled logits -> the rows' thresholds and candidates.
    branch (static): skip unused passes over V with lax.cond (False: no conditionals;
    see sampler.py). exact (static): include the exact search (False only when the host
    knows no row needs it: md.any_exact)."""
    R, V = x.shape
    C = num_candidates(V)
    # The barrier keeps XLA from folding our slices of the result into a full sort
    # (it then loses the fast TopK kernel on CPU: ~100x slower at V=49152).
    # One barrier per output: a barrier over the (vals, ids) tuple crashes XLA's
    # TopkDecomposer on sharded/multi-device compiles.
    vals, ids = jax.lax.top_k(x, C)
    vals, ids = jax.lax.optimization_barrier(vals), jax.lax.optimization_barrier(ids)
    m = vals[:, 0]
    k, p = md.top_k, md.top_p
    k_on = (k > 0) & (k < V)
    k_small = k_on & (k < C)
    thr_k = jnp.where(k_small, _take(vals, jnp.clip(k - 1, 0, C - 1)), -jnp.inf)

    # top-p over the candidates, normalised by the top-k set (or the whole vocab).
    e = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - m[:, None]), 0.0)
    p_on = p < 1
    z_all = _maybe(branch, jnp.any(p_on & ~k_small),     # an exp pass over V: only if used
                   lambda: jnp.sum(jnp.exp(x - m[:, None]), axis=1), lambda: jnp.ones_like(m))
    z = jnp.where(k_small, jnp.sum(e, axis=1), z_all)
    cum = cumsum_rows(e / z[:, None])
    excl = jnp.concatenate([jnp.zeros((R, 1)), cum[:, :-1]], axis=1)
    keep = excl < p[:, None]
    thr_p = jnp.where(p_on, _take(vals, jnp.sum(keep, axis=1) - 1), -jnp.inf)

    big_k = is_random & k_on & ~k_small
    p_exact = is_random & p_on & (big_k | (~k_small & keep[:, -1] & (C < V)))
    if exact:
        thr_k, thr_p = _maybe(
            branch, jnp.any(big_k | p_exact),
            lambda: _exact_thresholds(x, m, md, thr_k, thr_p, big_k, p_exact, branch),
            lambda: (thr_k, thr_p))

    thr_m = jnp.where(md.min_p > 0, m + jnp.log(jnp.maximum(md.min_p, 1e-30)), -jnp.inf)
    thr = jnp.maximum(jnp.maximum(thr_k, thr_p), thr_m)
    # Only rows that truncate draw from the candidates, so a row's path never depends
    # on whether another row of the batch truncates (matters when C == V).
    truncating = k_on | p_on | (md.min_p > 0)
    covered = truncating & ((C == V) | (thr > vals[:, -1]))
    return Cut(thr, covered, vals, ids.astype(jnp.int32))


def _maybe(branch: bool, pred: jax.Array, fn, otherwise):
    """fn() if pred else otherwise(), for an fn whose result is also right when pred
    is false: under lax.cond when branching, else fn() always (no conditional)."""
    return jax.lax.cond(pred, fn, otherwise) if branch else fn()


def _exact_thresholds(x, m, md, thr_k, thr_p, big_k, p_exact, branch=True):
    """Exact thresholds for the rows flagged big_k / p_exact (others pass through)."""
    keys = _sortable(x + 0.0)                    # + 0.0 maps -0.0 to +0.0
    thr_k = _maybe(
        branch, jnp.any(big_k),
        lambda: jnp.where(big_k, _search(keys, jnp.ones_like(x), md.top_k.astype(x.dtype)),
                          thr_k),
        lambda: thr_k)
    e = jnp.where(x >= thr_k[:, None], jnp.exp(x - m[:, None]), 0.0)
    target = md.top_p * jnp.sum(e, axis=1)
    return thr_k, jnp.where(p_exact, _search(keys, e, target), thr_p)


def _search(keys: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the least tau with sum(weight[x > tau]) < target, as a float threshold
    (kept set: x >= tau). keys [R, V] are x's order-preserving uint32 images."""
    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(keys > mid[:, None], weight, 0.0), axis=1)
        ok = above < target
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo0 = jnp.zeros(keys.shape[:1], jnp.uint32)
    lo, _ = jax.lax.fori_loop(0, 32, body, (lo0, jnp.max(keys, axis=1)))
    return jnp.where(lo <= jnp.min(keys, axis=1), -jnp.inf, _unsortable(lo))


def _sortable(x: jax.Array) -> jax.Array:
    """f32 -> uint32 with a < b  <=>  key(a) < key(b) (for non-NaN, with -0 == +0 merged)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unsortable(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
