"""The general rejection sampler (sampling/rejection_general.py) against independent
truths: a two-token Markov chain whose non-speculative distribution is known exactly
(chi-square goodness of fit of the first and second emitted tokens), transformers'
warpers for the controlled target distribution, the plain sampler's own draws, and
hand-computed greedy results."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sampling.metadata import build_sampling_metadata
from jaxserve.sampling.params import SamplingParams as SP
from jaxserve.sampling.penalties import init_penalty_state, record_tokens
from jaxserve.sampling.sampler import BRANCHED, SamplerPlan, sample
from jaxserve.sampling.rejection_general import (argmax_last, draft_uniforms,
                                                 rejection_sample, row_keys,
                                                 sampling_probs, verify_rows)
from test_spec_decode_sampling import _chi2_sf

V, K, N, T0 = 12, 3, 20000, 5     # vocab, proposals per row, rows (samples), context
_reject = jax.jit(rejection_sample)
_probs = jax.jit(sampling_probs, static_argnames="plan")
_keys = jax.jit(row_keys)
_draft_u = jax.jit(draft_uniforms, static_argnums=1)
_sample = jax.jit(sample)
_verify_rows = jax.jit(verify_rows)


def probs_of(logits: np.ndarray, params: list[SP], state=None, slots=None,
             plan: SamplerPlan = BRANCHED) -> np.ndarray:
    """[n, V] what the sampler draws from, for logit rows [n, V] with these settings."""
    n, vocab = logits.shape
    md = build_sampling_metadata(params, [0] * n, [()] * n, n, vocab)
    state = state if state is not None else init_penalty_state(1, vocab)
    slots = slots if slots is not None else np.zeros(n, np.int32)
    return np.asarray(_probs(jnp.asarray(logits, jnp.float32), md, state, jnp.asarray(slots),
                             plan=plan))


def keys_for(n: int, base: int, seeds: list[int | None] | None = None,
             output_pos: np.ndarray | None = None) -> jax.Array:
    seeds = seeds or [None] * n
    words = np.array([((s % (1 << 64)) >> 32, s & 0xFFFFFFFF) if s is not None else (0, 0)
                      for s in seeds], np.uint32)
    has = np.array([s is not None for s in seeds])
    pos = output_pos if output_pos is not None else np.zeros(n, np.int32)
    return _keys(words, has, pos, jax.random.PRNGKey(base))


def inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Host draw: per row, the first i with cumsum(probs)[i] > u * sum."""
    cum = np.cumsum(probs.astype(np.float64), axis=1)
    return np.argmax(cum > (u[:, None] * cum[:, -1:]), axis=1).astype(np.int32)


def assert_follows(samples: np.ndarray, probs: np.ndarray, what: str) -> None:
    """Chi-square goodness of fit of samples to probs [V]; zero-probability tokens must
    never appear."""
    probs = np.asarray(probs, np.float64) / np.sum(probs)
    counts = np.bincount(samples, minlength=probs.shape[0])
    zero = probs == 0
    assert counts[zero].sum() == 0, (what, "drew a zero-probability token", counts, probs)
    expected = probs[~zero] * len(samples)
    stat = float(np.sum((counts[~zero] - expected) ** 2 / expected))
    df = int((~zero).sum()) - 1
    assert _chi2_sf(stat, df) > 1e-3, (what, stat, df, counts, expected.round(1))


def spec_step(P: np.ndarray, Q: np.ndarray, ctx: np.ndarray, base: int):
    """One speculative step of the chain x' ~ P[x] with draft chain Q, from tokens ctx
    [n]: drafts drawn from Q with draft_uniforms, verified by rejection_sample."""
    n = ctx.shape[0]
    keys = keys_for(n, base)
    u = np.asarray(_draft_u(keys, K))
    d = np.empty((n, K), np.int32)
    prev = ctx
    for j in range(K):
        d[:, j] = prev = inverse_cdf(Q[prev], u[:, j])
    ctxs = np.concatenate([ctx[:, None], d], axis=1)                     # [n, K+1]
    out = _reject(P[ctxs], Q[ctxs[:, :K]], d, np.full(n, K, np.int32), keys,
                  np.zeros(n, bool))
    return np.asarray(out.tokens), np.asarray(out.num_accepted), d


CASES = {   # (target settings, draft settings)
    "plain": (dict(temperature=1.0), dict(temperature=1.0)),
    "q_zero_where_p_positive": (dict(temperature=0.8), dict(temperature=1.0, top_k=3)),
    "p_zero_where_q_positive": (dict(temperature=1.0, top_k=4, top_p=0.9),
                                dict(temperature=1.3)),
    "min_p_and_top_p": (dict(temperature=0.7, min_p=0.1, top_p=0.95),
                        dict(temperature=1.0, top_p=0.6)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_chain_first_and_second_token_match_plain_sampling(case):
    rng = np.random.default_rng(list(CASES).index(case))
    lp = rng.standard_normal((V, V)) * 1.5
    lq = 0.6 * lp + rng.standard_normal((V, V))         # a related but different draft
    p_set, q_set = CASES[case]
    P, Q = probs_of(lp, [SP(**p_set)] * V), probs_of(lq, [SP(**q_set)] * V)
    if "zero" in case:      # the case's support mismatch is really there
        a, b = (Q, P) if case.startswith("q_") else (P, Q)
        assert ((a == 0) & (b > 0)).any()

    tokens, acc, _ = spec_step(P, Q, np.full(N, T0, np.int32), base=1)
    # both paths run: acceptances (also past the first position) and rejections
    assert 0.1 < acc.mean() < K - 0.1 and (acc >= 2).mean() > 0.02, acc.mean()
    first = tokens[:, 0]
    later, _, _ = spec_step(P, Q, first, base=2)        # rows that stopped after one token
    second = np.where(acc >= 1, tokens[:, 1], later[:, 0])
    assert_follows(first, P[T0], "first")
    assert_follows(second, P[T0].astype(np.float64) @ P, "second")


def test_target_probs_match_transformers_warpers():
    """sampling_probs equals transformers' warpers (temperature, top-k, top-p, min-p),
    at V = 256 so both the candidate and the exact-search paths of truncation run."""
    torch = pytest.importorskip("torch")
    from transformers import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)
    rng = np.random.default_rng(3)
    logits = np.stack([rng.standard_normal(256) * s for s in (2.5, 0.3, 2.5, 0.3, 1.0)])
    params = [SP(temperature=0.7, top_k=20), SP(temperature=1.0, top_p=0.9),
              SP(temperature=1.3, top_k=200, top_p=0.8, min_p=0.01),
              SP(temperature=0.9, min_p=0.2), SP(temperature=1.0)]
    got = probs_of(logits.astype(np.float32), params)
    # the branch-free program (GPU) computes the same
    free = probs_of(logits.astype(np.float32), params, plan=SamplerPlan(False, True, True))
    np.testing.assert_allclose(free, got, atol=1e-7)
    for row, p in zip(range(len(params)), params):
        ws = [TemperatureLogitsWarper(p.temperature)]
        ws += [TopKLogitsWarper(p.top_k)] if p.top_k > 0 else []
        ws += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
        ws += [MinPLogitsWarper(p.min_p)] if p.min_p > 0 else []
        scores = torch.tensor(logits[row], dtype=torch.float64)[None]
        for w in ws:
            scores = w(None, scores)
        ref = torch.softmax(scores, -1)[0].numpy()
        assert np.array_equal(ref == 0, got[row] == 0), row
        np.testing.assert_allclose(got[row], ref, atol=2e-6, rtol=1e-4)


@pytest.mark.slow
def test_target_probs_are_what_the_plain_sampler_draws():
    """With bias, min_tokens and every penalty on, sampling_probs is the distribution
    sampler.sample draws from (chi-square over 8000 independent rows per setting)."""
    rng = np.random.default_rng(4)
    row = rng.standard_normal(V).astype(np.float32) * 1.5
    state = record_tokens(init_penalty_state(2, V), jnp.array([1, 1, 1]),
                          jnp.array([3, 3, 7]), jnp.ones(3, bool))
    settings = [SP(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.5,
                   repetition_penalty=1.3, logit_bias={4: 2.0, 9: -100.0}),
                SP(temperature=1.2, top_k=5, min_tokens=3, stop_token_ids=[6]),
                SP(temperature=0.8, top_p=0.8, repetition_penalty=0.7)]
    n = 8000
    for sp in settings:
        md = build_sampling_metadata([sp] * n, [0] * n, [(2,)] * n, n, V)
        slots = jnp.ones(n, jnp.int32)
        logits = jnp.asarray(np.tile(row, (n, 1)))
        draws = np.asarray(_sample(logits, md, state, slots, jax.random.PRNGKey(7)).token_ids)
        probs = np.asarray(_probs(logits[:1], jax.tree.map(lambda a: a[:1] if a.ndim else a,
                                                           md), state, slots[:1]))[0]
        if sp.min_tokens:           # the stop id and EOS are suppressed under min_tokens
            assert probs[6] == probs[2] == 0
        assert_follows(draws, probs, repr(sp))


def test_greedy_rows_are_exact_argmax_matching():
    rng = np.random.default_rng(5)
    R = 64
    logits = rng.standard_normal((R * (K + 1), V)).astype(np.float32)
    p = probs_of(logits, [SP(temperature=0.0)] * (R * (K + 1))).reshape(R, K + 1, V)
    best = logits.reshape(R, K + 1, V).argmax(axis=2)
    assert np.array_equal(p.argmax(axis=2), best) and set(np.unique(p)) == {0.0, 1.0}
    bad_at = np.arange(R) % (K + 1)                       # K: all proposals right
    d = best[:, :K].copy()
    for r in range(R):
        if bad_at[r] < K:
            d[r, bad_at[r]] = (d[r, bad_at[r]] + 1 + r % (V - 1)) % V
    n = np.where(np.arange(R) % 7 == 0, 1, K).astype(np.int32)
    # q is ignored for greedy rows: give it no mass on the right tokens at all
    q = rng.random((R, K, V)).astype(np.float32)
    q[np.arange(R)[:, None], np.arange(K)[None, :], best[:, :K]] = 0.0
    q /= q.sum(axis=2, keepdims=True)
    out = _reject(p, q, d, n, keys_for(R, 0), np.ones(R, bool))
    tokens, acc = np.asarray(out.tokens), np.asarray(out.num_accepted)
    want_a = np.minimum(bad_at, n)
    assert np.array_equal(acc, want_a)
    for r in range(R):
        a = want_a[r]
        assert tokens[r, :a + 1].tolist() == best[r, :a + 1].tolist(), r
        assert (tokens[r, a + 1:] == -1).all()


def test_seeded_rows_reproducible_whatever_the_batch():
    rng = np.random.default_rng(6)
    R = 32
    p = rng.dirichlet(np.ones(V), size=(R, K + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=(R, K)).astype(np.float32)
    d = rng.integers(0, V, size=(R, K)).astype(np.int32)
    n = np.full(R, K, np.int32)
    seeds = [1000 + r for r in range(R)]
    pos = np.arange(R, dtype=np.int32) * 3

    def run(order, base, seeded=True):
        ks = keys_for(R, base, [seeds[i] for i in order] if seeded else None, pos[order])
        out = _reject(p[order], q[order], d[order], n, ks, np.zeros(R, bool))
        inv = np.argsort(order)
        return np.asarray(out.tokens)[inv], np.asarray(out.num_accepted)[inv]

    ident = np.arange(R)
    a = run(ident, base=1)
    b = run(rng.permutation(R), base=2)       # other rows, other batch key
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # a seeded row's key moves with its output position (a fresh draw every step) and
    # not with the batch key
    k = np.asarray(keys_for(3, 1, [7, 7, 8], np.array([4, 5, 4], np.int32)))
    assert len({tuple(r) for r in k}) == 3
    assert np.array_equal(k, np.asarray(keys_for(3, 2, [7, 7, 8], np.array([4, 5, 4], np.int32))))
    # the keys matter: unseeded rows under another batch key give other tokens
    c, e = run(ident, base=1, seeded=False), run(ident, base=2, seeded=False)
    assert not np.array_equal(c[0], e[0])


def test_ragged_valid_counts_and_p_equal_q_accepts_everything():
    """p == q accepts all n valid proposals; the bonus comes from p_n; entries past a
    row's n are never read (NaN there must not leak)."""
    rng = np.random.default_rng(7)
    dists = rng.dirichlet(np.ones(V) * 0.7, size=K + 1).astype(np.float32)   # p_j per j
    n = (np.arange(N) % (K + 1)).astype(np.int32)
    p = np.broadcast_to(dists, (N, K + 1, V)).copy()
    q = p[:, :K].copy()
    keys = keys_for(N, 3)
    u = np.asarray(_draft_u(keys, K))
    d = np.stack([inverse_cdf(q[:, j], u[:, j]) for j in range(K)], axis=1)
    for r in range(N):                         # poison what must not be read
        p[r, n[r] + 1:] = np.nan
        q[r, n[r]:] = np.nan
        d[r, n[r]:] = -1
    out = _reject(p, q, d, n, keys, np.zeros(N, bool))
    tokens, acc = np.asarray(out.tokens), np.asarray(out.num_accepted)
    assert np.array_equal(acc, n)
    for m in range(K + 1):
        rows = n == m
        assert np.array_equal(tokens[rows, :m], d[rows, :m])
        assert (tokens[rows, m + 1:] == -1).all()
        assert_follows(tokens[rows, m], dists[m], f"bonus after {m} proposals")


def test_no_residual_mass_falls_back_to_p():
    """A rejection where max(0, p - q) is 0 everywhere (p == q, a proposal outside the
    support) draws from p instead of failing."""
    rng = np.random.default_rng(8)
    dist = rng.dirichlet(np.ones(V), size=1)[0].astype(np.float32)
    dist[[0, 1]] = 0.0
    dist /= dist.sum()
    n_rows = 8000
    p = np.broadcast_to(dist, (n_rows, K + 1, V)).copy()
    q = p[:, :K].copy()
    d = np.zeros((n_rows, K), np.int32)                   # token 0: p = q = 0 there
    out = _reject(p, q, d, np.full(n_rows, K, np.int32), keys_for(n_rows, 4),
                  np.zeros(n_rows, bool))
    assert (np.asarray(out.num_accepted) == 0).all()
    assert_follows(np.asarray(out.tokens)[:, 0], dist, "fallback")


def test_engine_layout_gives_each_row_the_tokens_of_rejection_sample():
    """verify_rows on the engine step's layout -- request rows of n_r + 1 logit rows
    back to back (n_r = 0: a plain row), padding rows after them -- gives every request
    row exactly the tokens rejection_sample gives it (greedy and sampled rows mixed)."""
    rng = np.random.default_rng(10)
    R = 40
    p = rng.dirichlet(np.ones(V) * 0.5, size=(R, K + 1)).astype(np.float32)
    q = (0.5 * p[:, :K] + 0.5 * rng.dirichlet(np.ones(V), size=(R, K))).astype(np.float32)
    keys = keys_for(R, 11)
    u = np.asarray(_draft_u(keys, K))
    d = np.stack([inverse_cdf(q[:, j], u[:, j]) for j in range(K)], axis=1).astype(np.int32)
    n = (np.arange(R) % (K + 1)).astype(np.int32)
    greedy = np.arange(R) % 5 == 0
    ref = _reject(p, q, d, n, keys, greedy)
    ref_tokens, ref_acc = np.asarray(ref.tokens), np.asarray(ref.num_accepted)

    G = int((n + 1).sum()) + 3                                  # + 3 padding rows
    fp, fq = np.zeros((G, V), np.float32), np.zeros((G, V), np.float32)
    prop, first = np.full(G, -1, np.int32), np.arange(G, dtype=np.int32)
    fkeys, fgreedy = np.zeros((G, 2), np.uint32), np.zeros(G, bool)
    valid = np.zeros(G, bool)
    at = 0
    for r in range(R):
        m = n[r] + 1
        fp[at:at + m], fq[at:at + m - 1], prop[at:at + m - 1] = p[r, :m], q[r, :m - 1], d[r, :m - 1]
        first[at:at + m], fkeys[at:at + m], fgreedy[at:at + m] = at, np.asarray(keys)[r], greedy[r]
        valid[at:at + m] = True
        at += m
    out = _verify_rows(fp, fq, prop, first, fkeys, fgreedy, valid)
    tokens, emitted = np.asarray(out.tokens), np.asarray(out.emitted)
    assert not emitted[at:].any() and (tokens[at:] == -1).all()
    at = 0
    for r in range(R):
        m = n[r] + 1
        assert tokens[at:at + m].tolist() == ref_tokens[r, :m].tolist(), r
        assert emitted[at:at + m].sum() == ref_acc[r] + 1, r
        at += m
    assert 0 < ref_acc.sum() < n.sum()          # acceptances and rejections both ran


def test_compiles_once_for_a_fixed_shape():
    traces = []

    def counted(*args):
        traces.append(1)                      # runs only while tracing
        return rejection_sample(*args)
    fn = jax.jit(counted)
    rng = np.random.default_rng(9)
    R = 16
    for i in range(3):
        p = rng.dirichlet(np.ones(V), size=(R, K + 1)).astype(np.float32)
        q = rng.dirichlet(np.ones(V), size=(R, K)).astype(np.float32)
        d = rng.integers(0, V, (R, K)).astype(np.int32)
        n = rng.integers(0, K + 1, R).astype(np.int32)
        out = fn(p, q, d, n, keys_for(R, i), rng.random(R) < 0.5)
        assert (np.asarray(out.num_accepted) <= n).all()
    assert len(traces) == 1


@pytest.mark.parametrize("width", [12, 256, 600])
def test_argmax_last_is_argmax_first_index(width):
    rng = np.random.default_rng(width)
    x = rng.integers(-3, 3, (4, 3, width)).astype(np.float32)    # many ties
    x[0, 0] = -np.inf
    x[1, 1, width // 2:] = 9.0                                    # the max past a block edge
    assert np.array_equal(np.asarray(jax.jit(argmax_last)(x)), x.argmax(axis=-1))
