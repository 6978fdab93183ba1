"""The batched sampler: distributions vs transformers' warpers, seeding, greedy, logprobs."""
from __future__ import annotations

from dataclasses import replace as dataclass_replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.sampling.metadata import build_sampling_metadata
from jaxserve.sampling.params import SamplingParams as SP
from jaxserve.sampling.penalties import init_penalty_state, record_tokens, set_prompt
from jaxserve.sampling.sampler import BRANCHED, SamplerPlan, sample
from jaxserve.sampling.truncation import TOPK_CAP

V = 256                      # > TOPK_CAP + 1, so both the candidate and vocab paths run
_sample = jax.jit(sample, static_argnames="num_logprobs")
_rng = np.random.default_rng(0)
PEAKED = (_rng.standard_normal(V) * 2.5).astype(np.float32)
FLAT = (_rng.standard_normal(V) * 0.3).astype(np.float32)


def run(params, logits, *, output_lens=None, key=0, state=None, slots=None):
    """Sample rows `params` (None: padding); small batches are padded to 8 rows and all
    calls ask for 5 logprobs, so the module compiles the sampler twice in all."""
    n = len(params)
    R = max(n, 8)
    params = list(params) + [None] * (R - n)
    logits = np.concatenate([logits, np.zeros((R - n, V), np.float32)])
    lens = list(output_lens or [0] * n) + [0] * (R - n)
    md = build_sampling_metadata(params, lens, [(1,)] * R, R, V)
    state = state if state is not None else init_penalty_state(2, V)
    slots = np.concatenate([slots if slots is not None else np.zeros(n, np.int32),
                            np.zeros(R - n, np.int32)])
    out = _sample(jnp.asarray(logits, jnp.float32), md, state, jnp.asarray(slots),
                  jax.random.PRNGKey(key), num_logprobs=5)
    return jax.tree.map(lambda a: np.asarray(a)[:n], out)


def hf_probs(logits: np.ndarray, p: SP) -> np.ndarray:
    """Reference distribution: transformers' warpers in generate()'s order."""
    import torch
    from transformers import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores, -1)[0].numpy()


# (logits, params): each path of truncation.py; the flat cases force the exact search.
CASES = [
    (PEAKED, SP(temperature=1.0)),
    (PEAKED, SP(temperature=0.7, top_k=10)),
    (PEAKED, SP(temperature=1.0, top_p=0.8)),
    (PEAKED, SP(temperature=1.3, min_p=0.05)),
    (PEAKED, SP(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02)),
    (FLAT, SP(temperature=1.0, top_p=0.7)),                 # mass beyond the candidates
    (FLAT, SP(temperature=1.0, top_k=TOPK_CAP + 40)),       # k beyond the cap
    (FLAT, SP(temperature=2.0, top_k=200, top_p=0.9, min_p=0.5)),
]
DRAWS = 2500


@pytest.fixture(scope="module")
def mixed_batch_tokens():
    """All CASES in ONE batch (different settings per row), DRAWS rows each."""
    params = [p for _, p in CASES for _ in range(DRAWS)]
    logits = np.concatenate([np.tile(lg, (DRAWS, 1)) for lg, _ in CASES])
    return np.asarray(run(params, logits, key=1).token_ids).reshape(len(CASES), DRAWS)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_frequencies_match_transformers_warpers(mixed_batch_tokens, case):
    logits, p = CASES[case]
    expected = hf_probs(logits, p)
    counts = np.bincount(mixed_batch_tokens[case], minlength=V)
    assert counts[expected == 0].sum() == 0, "sampled a token the warpers remove"
    big = expected * DRAWS >= 5            # chi-square needs >= 5 expected per bin
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum()) * DRAWS
    keep = exp > 0
    if keep.sum() > 1:
        assert stats.chisquare(obs[keep], exp[keep]).pvalue > 1e-3


def test_greedy_and_top_k_1_take_argmax_with_mixed_rows():
    logits = _rng.standard_normal((6, V)).astype(np.float32)
    params = [SP(temperature=0), SP(top_k=1), SP(temperature=1e-6), SP(top_k=1, top_p=0.5),
              None, SP(temperature=0, top_k=3)]
    tokens = np.asarray(run(params, logits).token_ids)
    np.testing.assert_array_equal(tokens, logits.argmax(1))


def _seeded_row(row_params, row, others, logits_row, other_logits, pos, key):
    params = list(others)
    params.insert(row, row_params)
    logits = np.insert(other_logits, row, logits_row, axis=0)
    lens = [3] * len(params)
    lens[row] = pos
    return int(run(params, logits, output_lens=lens, key=key).token_ids[row])


@pytest.mark.parametrize("seeded", [SP(seed=7), SP(seed=2**40 + 3, top_k=5, temperature=2.0),
                                    SP(seed=-1, top_p=0.95)])
def test_seeded_row_is_independent_of_batch(seeded):
    others_a = [SP(temperature=0)] * 3                      # no other random work runs
    others_b = [SP(), SP(top_k=TOPK_CAP + 10), SP(top_p=0.5), SP(min_p=0.2), None]
    oa = _rng.standard_normal((3, V)).astype(np.float32)
    ob = _rng.standard_normal((5, V)).astype(np.float32)
    a = [_seeded_row(seeded, 0, others_a, FLAT, oa, pos, key=1) for pos in range(8)]
    b = [_seeded_row(seeded, 4, others_b, FLAT, ob, pos, key=2) for pos in range(8)]
    assert a == b
    assert len(set(a)) > 1, "positions must draw different numbers"


def test_unseeded_rows_differ_across_rows_and_steps():
    params = [SP(temperature=1.0)] * 8
    logits = np.tile(FLAT, (8, 1))
    t1 = np.asarray(run(params, logits, key=1).token_ids)
    t2 = np.asarray(run(params, logits, key=2).token_ids)
    assert len(set(t1.tolist())) >= 6
    assert (t1 != t2).sum() >= 6


def test_logprobs_are_raw_log_softmax_with_ranks():
    R, n = 4, 5                                  # run() asks for 5
    logits = _rng.standard_normal((R, V)).astype(np.float32) * 3
    state = set_prompt(init_penalty_state(2, V), 0, jnp.arange(8), 8)
    state = record_tokens(state, jnp.zeros(1, jnp.int32), jnp.array([9]), jnp.array([True]))
    params = [SP(temperature=0, repetition_penalty=1.5, logit_bias={3: 100.0}),
              SP(temperature=0.5, top_k=3, presence_penalty=1.0), SP(temperature=2.0), None]
    out = run(params, logits, state=state)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=1))
    tok = np.asarray(out.token_ids)
    lp, ids = np.asarray(out.logprobs), np.asarray(out.logprob_token_ids)
    assert lp.shape == ids.shape == (R, n + 1)
    np.testing.assert_array_equal(ids[:, 0], tok)
    np.testing.assert_allclose(lp[:, 0], ref[np.arange(R), tok], atol=1e-5)
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-logits, axis=1)[:, :n])
    np.testing.assert_allclose(lp[:, 1:], np.take_along_axis(ref, ids[:, 1:], 1), atol=1e-5)
    ranks = (logits >= logits[np.arange(R), tok][:, None]).sum(1)
    np.testing.assert_array_equal(np.asarray(out.sampled_rank), ranks)
    assert tok[0] == 3                           # the bias moved the greedy pick


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = np.zeros((3, V), np.float32)
    logits[:, 1] = 50.0                          # EOS (id 1 in run()) dominates
    logits[:, 7] = 40.0                          # a stop token comes next
    logits[:, 9] = 30.0
    params = [SP(temperature=0, min_tokens=4, stop_token_ids=[7])] * 2 + [
        SP(temperature=0, min_tokens=4, ignore_eos=True)]
    out = run(params, logits, output_lens=[3, 4, 0])
    assert np.asarray(out.token_ids).tolist() == [9, 1, 1]


def test_one_compilation_for_any_mix_of_settings():
    logits = np.tile(PEAKED, (4, 1))
    run([None] * 4, logits)
    compiled = _sample._cache_size()
    for params in ([SP(temperature=0)] * 4,
                   [SP(top_k=3, seed=1), SP(presence_penalty=1.0), SP(logit_bias={1: 2.0}),
                    SP(min_tokens=2, top_p=0.5)],
                   [SP(top_k=TOPK_CAP + 1), SP(top_p=0.1), SP(min_p=0.9), SP(seed=3)]):
        run(params, logits, output_lens=[0, 1, 2, 3])
    assert _sample._cache_size() == compiled


# ---- branch-free plans (the GPU form: no lax.cond in the program) ---------------------------
_sample_plan = jax.jit(sample, static_argnames=("num_logprobs", "plan"))


def run_both(params, logits, *, output_lens=None, key=0, state=None, slots=None):
    """(branched output, branch-free output with the plan the host picks, that plan)."""
    n = len(params)
    R = max(n, 8)
    params = list(params) + [None] * (R - n)
    logits = np.concatenate([logits, np.zeros((R - n, V), np.float32)]).astype(np.float32)
    lens = list(output_lens or [0] * n) + [0] * (R - n)
    md = build_sampling_metadata(params, lens, [(1,)] * R, R, V)
    state = state if state is not None else init_penalty_state(2, V)
    slots = jnp.asarray(np.concatenate([slots if slots is not None else np.zeros(n, np.int32),
                                        np.zeros(R - n, np.int32)]))
    plan = SamplerPlan.for_step(md)
    outs = [_sample_plan(jnp.asarray(logits), md, state, slots, jax.random.PRNGKey(key),
                         num_logprobs=5, plan=p) for p in (BRANCHED, plan)]
    return *(jax.tree.map(lambda a: np.asarray(a)[:n], o) for o in outs), plan


@pytest.mark.parametrize("batch", ["cases", "greedy", "temperature", "penalised"])
def test_branch_free_plan_draws_what_the_branched_sampler_draws(batch):
    state = set_prompt(init_penalty_state(2, V), 0, jnp.arange(8), 8)
    state = record_tokens(state, jnp.zeros(1, jnp.int32), jnp.array([9]), jnp.array([True]))
    if batch == "cases":       # every truncation path, seeded and not, in one batch
        params = [dataclass_replace(p, seed=(i if i % 2 else None))
                  for i, (_, p) in enumerate(CASES * 4)]
        logits = np.stack([lg for lg, _ in CASES * 4])
    else:
        params = {"greedy": [SP(temperature=0)] * 5,
                  "temperature": [SP(temperature=1.0), SP(temperature=0.5, seed=3)] * 3,
                  "penalised": [SP(temperature=0, repetition_penalty=1.5, logit_bias={3: 30.0}),
                                SP(temperature=0.9, presence_penalty=1.0, min_tokens=2,
                                   top_k=3)] * 3}[batch]
        # its own draw: the module's generator's state depends on which tests ran before
        seed = ["greedy", "temperature", "penalised"].index(batch)
        logits = np.random.default_rng(seed).standard_normal((len(params), V)) * 2
        logits = logits.astype(np.float32)
    branched, free, plan = run_both(params, logits, state=state, key=3)
    assert not plan.branch
    assert plan.sample == (batch != "greedy") and plan.exact == (batch == "cases")
    np.testing.assert_array_equal(free.token_ids, branched.token_ids)
    np.testing.assert_array_equal(free.logprob_token_ids, branched.logprob_token_ids)
    np.testing.assert_allclose(free.logprobs, branched.logprobs, atol=1e-6)
    if batch == "penalised":
        assert branched.token_ids[0] == 3          # the bias (> any logit) ran in both forms


def test_exact_search_flag_is_set_on_the_host_when_a_row_may_need_it():
    def flag(*ps):
        return bool(build_sampling_metadata(list(ps), [0] * len(ps), [()] * len(ps), 4,
                                            V).any_exact)
    assert flag(SP(top_p=0.9))                                   # mass may pass C
    assert flag(SP(top_k=TOPK_CAP + 1))                          # k beyond the cap
    assert flag(SP(top_k=200, top_p=0.5), SP(top_k=3))
    assert not flag(SP(top_k=10, top_p=0.9), SP(min_p=0.1), SP())  # read off candidates
    assert not flag(SP(temperature=0, top_p=0.5))                # greedy rows never search


def test_branch_free_sampler_lowers_without_conditionals():
    md = build_sampling_metadata([SP(top_p=0.5)] * 4, [0] * 4, [(1,)] * 4, 4, V)
    args = (jnp.zeros((4, V)), md, init_penalty_state(2, V), jnp.zeros(4, jnp.int32),
            jax.random.PRNGKey(0))

    def conds(plan):
        text = _sample_plan.lower(*args, num_logprobs=5, plan=plan).as_text()
        return text.count("stablehlo.case") + text.count("stablehlo.if")
    for sample_, exact in [(False, False), (True, False), (True, True)]:
        assert conds(SamplerPlan(False, sample=sample_, exact=exact)) == 0
    assert conds(BRANCHED) >= 7               # the check can fail: the branched form has them
