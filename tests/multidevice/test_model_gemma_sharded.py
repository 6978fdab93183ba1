"""Gemma 2 / Gemma 3 under tensor parallelism on simulated CPU devices: greedy tokens and
prompt logprobs (chunked prefill) equal to one device's.

Gemma 2's 3 query heads over 1 KV head split at TP=3 (the KV head copied to each rank);
Gemma 3's 5 heads split at TP=5; at TP=2 only the vocabulary / MLP split.
"""
from __future__ import annotations

import pytest

from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM
from jaxserve.model.loader.load import load_model
from test_model_gemma import CHUNKED, TEXTS, save_gemma


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def loaded(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_gemma(request.param, path)
    lm = load_model(str(path), progress=False)
    return request.param, lm, [lm.tokenizer(t).input_ids for t in TEXTS[:3]]


def run(lm, prompts, tp: int, heads_split: bool = False):
    llm = LLM.from_weights(lm.config, lm.weights, lm.tokenizer, tensor_parallel_size=tp,
                           **CHUNKED)
    if tp > 1:   # the plan really splits what the test says it splits
        plan = llm.engine.runner.plan
        assert plan.decisions["heads"].sharded == heads_split, plan.decisions["heads"]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs]


@pytest.fixture(scope="module")
def one_device(loaded):
    _, lm, prompts = loaded
    return run(lm, prompts, 1)


HEAD_SPLIT = {"gemma2": 3, "gemma3": 5}     # TP = the query heads: each rank one head


@pytest.mark.parametrize("split", ["tp2", "heads"])
def test_tensor_parallel_equals_one_device(loaded, one_device, split):
    variant, lm, prompts = loaded
    tp = 2 if split == "tp2" else HEAD_SPLIT[variant]
    got = run(lm, prompts, tp, heads_split=split == "heads")
    for (toks, plp), (ref_toks, ref_plp) in zip(got, one_device):
        assert toks == ref_toks, (variant, tp)
        for a, b in zip(plp[1:], ref_plp[1:]):
            for t in b:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4, (variant, tp)
