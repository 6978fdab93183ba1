"""Sampled drafting for the device drafters (`self`, `draft_model`): sampled rows propose
draws from the draft's own controlled distribution q and the step verifies them by the
general rule (accept with min(1, p/q), residual max(0, p - q), bonus); seeded rows keep
argmax drafting and matching, so their tokens stay plain decoding's. Truths: plain
sampling of the same model without speculation (chi-square two-sample tests per output
position and of a pair), the plain engine's greedy outputs, repeated and regrouped runs
(seeded), the compile counter, and a draft that computes the target's own distribution
(q == p: every proposal must be accepted) against one-hot drafts of the same draft
(accepted with probability p(argmax) only)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_utils import random_prompts, tiny_config, tiny_tokenizer
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM
from jaxserve.model.params import init_params
from jaxserve.worker.drafter.draft_step import DraftPrograms
from test_spec_decode_sampling import _chi2_sf, _chi2_two_sample

VOCAB, K = 12, 3
# num_kv_blocks: every sequence at full length fits twice over (64 x 64 tokens in blocks of
# 16 is 256), instead of a pool sized by bytes: this module holds four engines at once,
# beside the other test worker's
ARGS = dict(max_model_len=64, max_num_seqs=64, max_num_batched_tokens=64,
            token_buckets=[16, 64], max_logprobs=5, num_kv_blocks=512)
PROMPT = [4, 7, 9, 4, 7, 9, 4, 7]
CONTROLS = {
    "temperature_1": dict(temperature=1.0),
    "all_controls": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02,
                         presence_penalty=0.6, frequency_penalty=0.3,
                         repetition_penalty=1.2, logit_bias={5: 1.5}),
}


def _model(last_scale: float, seed: int = 5):
    """Three layers; the last one's output projections scaled by last_scale: the
    first two layers (the drafts) then compute a distribution near the target's
    (last_scale small), or exactly the target's (0: the last layer adds nothing)."""
    cfg = tiny_config(vocab_size=VOCAB, num_layers=3)
    w = init_params(cfg, seed=seed, scale=0.12)
    last = dict(w["layers"][2])
    for name in ("wo", "w_down"):
        last[name] = last[name] * last_scale
    return cfg, {**w, "layers": [*w["layers"][:2], last]}, tiny_tokenizer(VOCAB)


def _save(cfg, weights, tok, path) -> str:
    from jaxserve.model.export import to_transformers
    to_transformers(cfg, weights).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _engine(model, method: str | None, tmp_path_factory=None):
    cfg, w, tok = model
    spec = None
    if method == "self":
        spec = {"method": "self", "draft_num_layers": 2, "num_speculative_tokens": K}
    elif method == "draft_model":       # a checkpoint of the target's first two layers
        path = _save(dataclasses.replace(cfg, num_layers=2), {**w, "layers": w["layers"][:2]},
                     tok, tmp_path_factory.mktemp("draft"))
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    return LLM.from_weights(cfg, w, tok, speculative_config=spec, **ARGS)


@pytest.fixture(scope="module")
def model():
    return _model(last_scale=2.0)


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    return {m: _engine(model, m, tmp_path_factory) for m in (None, "self", "draft_model")}


def _samples(llm, params: SamplingParams, num: int) -> np.ndarray:
    """num sampled outputs of PROMPT (unseeded), n at a time: the batch stays far below
    max_num_seqs, so every row has room for its proposals."""
    rows = []
    for _ in range(num // params.n):
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
        rows += [c.token_ids for c in out.outputs]
    return np.array(rows)


NUM = 1024


@pytest.fixture(scope="module")
def plain_samples():
    return {}        # controls -> NUM samples of the engine without speculation (lazily)


@pytest.mark.parametrize("controls", list(CONTROLS))
@pytest.mark.parametrize("method", ["self", "draft_model"])
@pytest.mark.slow
def test_chi_square_sampled_drafts_match_plain_sampling(engines, plain_samples, method,
                                                        controls):
    params = SamplingParams(n=16, max_tokens=5, ignore_eos=True, **CONTROLS[controls])
    if controls not in plain_samples:
        plain_samples[controls] = _samples(engines[None], params, NUM)
    b = plain_samples[controls]
    llm = engines[method]
    st = llm.engine.scheduler.spec_stats
    acc0, drafts0 = st.num_accepted_tokens, st.num_draft_tokens
    a = _samples(llm, params, NUM)
    accepted, drafted = st.num_accepted_tokens - acc0, st.num_draft_tokens - drafts0
    # both paths of the rule ran many times: acceptances and residual draws
    assert accepted > drafted // 5 and drafted - accepted > drafted // 10, (accepted, drafted)
    for pos in range(1, 5):      # position 0 comes from the prompt's step (no proposals)
        stat, df = _chi2_two_sample(a[:, pos], b[:, pos], VOCAB)
        assert _chi2_sf(stat, df) > 1e-3, (pos, stat, df)
    stat, df = _chi2_two_sample(a[:, 1] * VOCAB + a[:, 2], b[:, 1] * VOCAB + b[:, 2],
                                VOCAB * VOCAB)
    assert _chi2_sf(stat, df) > 1e-3, ("pair", stat, df)


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.warmup
@pytest.mark.parametrize("method", ["self", "draft_model"])
def test_mixed_batch_greedy_identical_seeded_reproducible_no_recompiles(engines, method):
    """Greedy, seeded and unseeded sampled requests in one batch (one step verifies all
    three kinds; the unseeded ones by the general rule): greedy and seeded rows equal
    plain decoding token for token (seeded rows keep argmax drafting and matching); a
    seeded request gives the same tokens again, in another order and in a smaller batch;
    nothing compiles after warm-up."""
    llm = engines[method]
    warm = llm.num_compiles
    prompts = random_prompts(12, VOCAB, 3, 6, seed=11)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) if i % 3 == 0
              else SamplingParams(max_tokens=12, seed=50 + i, temperature=0.9, top_k=8,
                                  presence_penalty=0.3, ignore_eos=True) if i % 3 == 1
              else SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
              for i in range(len(prompts))]
    exact = [i for i in range(len(prompts)) if i % 3 != 2]
    st = llm.engine.scheduler.spec_stats
    acc0 = st.num_accepted_tokens
    got = _run(llm, prompts, params)
    assert st.num_accepted_tokens > acc0
    plain = _run(engines[None], prompts, params)
    assert [got[i] for i in exact] == [plain[i] for i in exact]
    got = [got[i] for i in exact]
    prompts, params = [prompts[i] for i in exact], [params[i] for i in exact]
    assert _run(llm, prompts, params) == got
    order = list(range(len(prompts)))[::-1]
    assert _run(llm, [prompts[i] for i in order], [params[i] for i in order]) == got[::-1]
    assert _run(llm, prompts[1:4:2], params[1:4:2]) == got[1:4:2]
    assert llm.num_compiles == warm


def _acceptance(llm, prompts, params) -> float:
    st = llm.engine.scheduler.spec_stats
    acc0, drafts0 = st.num_accepted_tokens, st.num_draft_tokens
    _run(llm, prompts, params)
    assert st.num_draft_tokens - drafts0 > 100
    return (st.num_accepted_tokens - acc0) / (st.num_draft_tokens - drafts0)


def test_draft_equal_to_target_accepts_everything():
    """The last layer adds nothing, so the first two (the self draft) compute exactly
    the target's distribution: q == p up to rounding, and every sampled proposal must
    be accepted; drafting the same draft's argmax (one-hot q) is accepted only with
    probability p(argmax) (well below 1 on this gentle model)."""
    llm = _engine(_model(last_scale=0.0), "self")
    prompts = random_prompts(6, VOCAB, 3, 10, seed=12)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, ignore_eos=True)
    sampled = _acceptance(llm, prompts, params)
    drafter = llm.engine.runner.drafter
    p = drafter.programs
    drafter.programs = DraftPrograms(p.cfg, p.inv_freq, p.attn_fn, p.on_trace,
                                     sample_drafts=False)
    one_hot = _acceptance(llm, prompts, params)
    assert sampled > 0.98, sampled
    assert one_hot < 0.8 and sampled > one_hot + 0.15, (sampled, one_hot)


@pytest.mark.warmup
@pytest.mark.slow
def test_branch_free_form(model, engines, monkeypatch):
    """The form a GPU runs (no data-dependent conditionals: branch-free sampler programs
    chosen on the host, the drafter's sampled path in every step): greedy rows equal
    plain greedy decoding, seeded requests repeat, proposals are accepted and
    rejected, nothing compiles after warm-up."""
    from jaxserve.worker import step_config as step_config_mod
    monkeypatch.setattr(step_config_mod, "step_platform", lambda plan: "gpu")
    cfg, w, tok = model
    llm = LLM.from_weights(cfg, w, tok, step_mode="fused", **ARGS, speculative_config={
        "method": "self", "draft_num_layers": 2, "num_speculative_tokens": K})
    assert not llm.engine.runner.branch
    warm = llm.num_compiles
    prompts = random_prompts(8, VOCAB, 3, 6, seed=13)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) if i % 2 == 0
              else SamplingParams(max_tokens=12, seed=70 + i, temperature=1.0, top_p=0.9,
                                  ignore_eos=True)
              for i in range(len(prompts))]
    got = _run(llm, prompts, params)
    assert got == _run(engines[None], prompts, params)    # greedy and seeded: plain's
    assert _run(llm, prompts, params) == got
    _run(llm, prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))     # all greedy
    st = llm.engine.scheduler.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert llm.num_compiles == warm
