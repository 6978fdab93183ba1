"""The layerwise step's layer groups (--layers-per-call): running G consecutive layers
per jitted call must change speed only. The truth is the one-layer-per-call engine
(itself checked against transformers in test_engine.py) and transformers directly."""
from __future__ import annotations

import pytest
from jax import monitoring

from engine_utils import (hf_greedy, hf_model_from_weights, random_prompts, tiny_config,
                          tiny_tokenizer, tiny_weights)
from jaxserve import SamplingParams
from jaxserve.model.cpu import SMALL_STEP_TOKENS
from jaxserve.worker.buckets import BucketSet
from jaxserve.worker.step_config import resolve_step_config
from jaxserve.config import EngineArgs
from jaxserve.frontend.llm import LLM

# these tests count compiles after warm-up: their engines warm up at start
pytestmark = pytest.mark.warmup

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True,
                         logprobs=2)


_BACKEND_COMPILES: list[float] = []     # every XLA compile in this process (jax's own event)
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _BACKEND_COMPILES.append(secs)
    if name.endswith("backend_compile_duration") else None)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(num_layers=5)       # 5 layers: groups of 2 leave a group of 1
    return cfg, tiny_weights(cfg), tiny_tokenizer()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 128, 3, 70, seed=4)


@pytest.fixture(scope="module")
def engines(model):
    """engines(layers_per_call) -> the module's engine for that grouping, built (and
    warmed up) once: both tests run groups of 1 and 2."""
    cfg, w, tok = model
    built: dict[int, LLM] = {}

    def get(layers_per_call: int) -> LLM:
        if layers_per_call not in built:
            built[layers_per_call] = LLM.from_weights(
                cfg, w, tok, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                token_buckets=[1, 2, 4, 8, 16, 64], step_mode="layerwise",
                layers_per_call=layers_per_call)
        return built[layers_per_call]
    return get


def _run(engines, prompts, params, layers_per_call):
    llm = engines(layers_per_call)
    assert llm.engine.reset_prefix_cache()      # every run computes its prompts whole
    warm, compiled = llm.num_compiles, len(_BACKEND_COMPILES)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.num_compiles == warm, "a layer group was traced after warm-up"
    # jax's own count: no XLA compile either (a sharding mismatch between the AOT
    # warm-up and the real call would recompile without tracing again)
    assert len(_BACKEND_COMPILES) == compiled, "an XLA compile after warm-up"
    return outs


@pytest.mark.slow
def test_groups_change_nothing(model, engines, prompts):
    one = _run(engines, prompts, GREEDY, layers_per_call=1)
    hf = hf_model_from_weights(model[0], model[1])
    assert [o.outputs[0].token_ids for o in one] == [hf_greedy(hf, p, 10) for p in prompts]
    for g in (2, 5, 0):                   # 2: groups 2, 2, 1; 5: all layers; 0: auto
        outs = _run(engines, prompts, GREEDY, layers_per_call=g)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in one]


@pytest.mark.slow
def test_groups_keep_sampling_and_logprobs(engines, prompts):
    one = _run(engines, prompts, SAMPLED, layers_per_call=1)
    two = _run(engines, prompts, SAMPLED, layers_per_call=2)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-5)


def test_auto_groups_small_steps_only():
    buckets = BucketSet.build(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512,
                              block_size=16)
    auto = resolve_step_config(EngineArgs(), num_layers=30, buckets=buckets, plan=None,
                               speculative=False)
    assert ([auto.layers_for(t) for t in (1, SMALL_STEP_TOKENS, 2 * SMALL_STEP_TOKENS, 512)]
            == [30, 30, 1, 1])
    fixed = resolve_step_config(EngineArgs(layers_per_call=6), num_layers=30,
                                buckets=buckets, plan=None, speculative=False)
    assert fixed.layers_for(1) == fixed.layers_for(512) == 6
