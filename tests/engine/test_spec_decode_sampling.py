"""Speculative decoding keeps the sampled distribution: a chi-square two-sample test of
speculative vs plain sampling on a small-vocabulary tiny model, and seeded requests
(every sampling control on) token-identical to plain decoding (rejection.py: with
deterministic proposals the verification draws with each position's own uniform)."""
from __future__ import annotations

import numpy as np
import pytest

from engine_utils import random_prompts, tiny_config, tiny_tokenizer
from spec_utils import use_oracle
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM

VOCAB = 12
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
        "prompt_lookup_min": 1}
ARGS = dict(max_model_len=64, max_num_seqs=64, max_num_batched_tokens=64,
            token_buckets=[16, 64], enable_prefix_caching=True, max_logprobs=5)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(vocab_size=VOCAB)
    # a gentler init than engine_utils' (0.25) keeps several tokens likely per position
    from jaxserve.model.params import init_params
    return cfg, init_params(cfg, seed=5, scale=0.08), tiny_tokenizer(VOCAB)


def _llm(model, spec):
    cfg, w, tok = model
    return LLM.from_weights(cfg, w, tok, speculative_config=spec, **ARGS)


@pytest.fixture(scope="module")
def engines(model):
    return _llm(model, SPEC), _llm(model, None)


def _greedy(llm, prompts, n):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _samples(llm, prompt, params, num):
    """num sampled outputs of one prompt (unseeded), n at a time: the batch stays
    far below max_num_seqs, so every row has room for its proposals."""
    rows = []
    for _ in range(num // params.n):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        rows += [c.token_ids for c in out.outputs]
    return np.array(rows)


def _chi2_two_sample(a: np.ndarray, b: np.ndarray, k: int) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples over k categories
    (categories seen in neither sample dropped)."""
    ca, cb = np.bincount(a, minlength=k), np.bincount(b, minlength=k)
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    return stat, int(keep.sum()) - 1


def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x), Wilson-Hilferty normal approximation (well within 10% of the
    exact tail at these df and p ~ 1e-3; no scipy needed)."""
    import math
    if df <= 0:
        return 1.0
    v = 2.0 / (9.0 * df)
    z = ((x / df) ** (1.0 / 3.0) - (1.0 - v)) / math.sqrt(v)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


@pytest.mark.parametrize("controls", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02, presence_penalty=0.6,
         frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 1.5}),
])
@pytest.mark.slow
def test_chi_square_speculative_matches_plain_sampling(engines, controls):
    prompt = [4, 7, 9, 4, 7, 9, 4, 7]            # copy-heavy: proposals 9 4 7 ...
    params = SamplingParams(n=16, max_tokens=4, ignore_eos=True, **controls)
    spec_llm, plain_llm = engines
    # proposals: the greedy continuation (likely tokens, so many are accepted)
    use_oracle(spec_llm, [prompt], _greedy(plain_llm, [prompt], 4))
    num = 1024
    st = spec_llm.engine.scheduler.spec_stats
    acc0, drafts0 = st.num_accepted_tokens, st.num_draft_tokens
    a, b = _samples(spec_llm, prompt, params, num), _samples(plain_llm, prompt, params, num)
    accepted = st.num_accepted_tokens - acc0
    assert accepted > num // 8, "too few proposals accepted to test anything"
    assert st.num_draft_tokens - drafts0 > accepted
    # each later position's marginal, and the (2nd, 3rd) pair jointly
    for pos in (1, 2, 3):
        stat, df = _chi2_two_sample(a[:, pos], b[:, pos], VOCAB)
        assert _chi2_sf(stat, df) > 1e-3, (pos, stat, df)
    stat, df = _chi2_two_sample(a[:, 1] * VOCAB + a[:, 2], b[:, 1] * VOCAB + b[:, 2],
                                VOCAB * VOCAB)
    assert _chi2_sf(stat, df) > 1e-3, ("pair", stat, df)


def test_seeded_requests_identical_to_plain_decoding(engines):
    prompts = [[4, 7, 9, 4, 7, 9, 4, 7], [3, 5, 3, 5, 3, 5]] + random_prompts(6, VOCAB, 3, 20, 2)
    params = [SamplingParams(max_tokens=12, seed=100 + i, ignore_eos=i % 2 == 0, n=2,
                             temperature=0.7 + 0.1 * i, top_k=[0, 5, 8][i % 3],
                             presence_penalty=0.4 * (i % 2), repetition_penalty=1.1,
                             min_tokens=3, logit_bias={6: -1.0})
              for i in range(len(prompts))]
    spec_llm, plain_llm = engines
    use_oracle(spec_llm, prompts, _greedy(plain_llm, prompts, 12))

    def run(m):
        outs = m.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]
    st = spec_llm.engine.scheduler.spec_stats
    acc0 = st.num_accepted_tokens
    assert run(spec_llm) == run(plain_llm)
    assert st.num_accepted_tokens > acc0
