"""The fused step (the default on GPU/TPU: the whole step is one jitted function) under the
engine's parity and zero-recompile tests, for both attention backends (the jnp reference
and the Pallas kernel, interpreted on CPU), on one device and sharded over simulated
devices: TP=2 (KV heads split), TP=4 (KV heads replicated, each device reading its one
KV head by offset, vLLM-style) and DP=2 x TP=2. The truth is transformers.
"""
from __future__ import annotations

import pytest

from engine_utils import (hf_greedy, hf_model_from_weights, random_prompts, tiny_config,
                          tiny_tokenizer, tiny_weights)
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM
from jaxserve.worker.step_programs import FusedStep


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# A 24-token budget splits every longer prompt into chunks, and 12 blocks of 16 tokens
# cannot hold 8 running sequences: steps mix prefill chunks with context, decodes and
# preemptions.
TIGHT = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=24,
             token_buckets=[24], num_kv_blocks=12, step_mode="fused")


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()          # 4 query heads, 2 KV heads, 2 layers
    return cfg, tiny_weights(cfg), tiny_tokenizer()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, 128, 3, 70, seed=11)


@pytest.fixture(scope="module")
def reference(model, prompts):
    cfg, w, _ = model
    hf = hf_model_from_weights(cfg, w)
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def _greedy(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _steps(llm) -> list:
    eng = llm.engine
    return [r.runner._step for r in getattr(eng, "replicas", [eng])]


# Pallas at TP=2 runs as the DP=2 x TP=2 engine's two replicas (each one the TP=2
# engine on its own 2 devices), not again as an engine of its own.
MATRIX = [("reference", 1, 1), ("pallas", 1, 1), ("reference", 2, 1), ("pallas", 4, 1),
          ("pallas", 2, 2)]
_ENGINES: dict[tuple[str, int, int], LLM] = {}


def _engine(model, backend: str, tp: int, dp: int) -> LLM:
    """The module's TIGHT engine per (backend, TP, DP): the varied-sampling test reuses
    the parity test's engines, whose programs are what it checks."""
    key = (backend, tp, dp)
    if key not in _ENGINES:
        cfg, w, tok = model
        _ENGINES[key] = LLM.from_weights(cfg, w, tok, attention_backend=backend,
                                         tensor_parallel_size=tp, data_parallel_size=dp,
                                         **TIGHT)
    return _ENGINES[key]


@pytest.fixture(scope="module", autouse=True)
def _drop_engines():
    yield
    _ENGINES.clear()


@pytest.mark.warmup
@pytest.mark.parametrize("backend,tp,dp", MATRIX,
                         ids=[f"{b}-tp{t}-dp{d}" for b, t, d in MATRIX])
def test_fused_step_equals_transformers_without_recompiles(model, prompts, reference,
                                                           backend, tp, dp):
    llm = _engine(model, backend, tp, dp)
    assert all(isinstance(s, FusedStep) for s in _steps(llm))
    warm = llm.num_compiles
    # per replica: one step per bucket shape (prompt-logprob programs compile on first
    # use, and the varied-sampling test, if it ran first on this engine, compiled none)
    buckets = llm.engine.replicas[0].buckets if dp > 1 else llm.engine.buckets
    assert warm == dp * len(buckets.all_shapes())
    eng = llm.engine.replicas if dp > 1 else [llm.engine]
    preempted = sum(e.scheduler.num_preemptions for e in eng)
    assert _greedy(llm, prompts) == reference
    assert sum(e.scheduler.num_preemptions for e in eng) > preempted, \
        "no request was preempted"
    assert llm.num_compiles == warm


@pytest.mark.warmup
@pytest.mark.parametrize("backend,tp", [("reference", 1), ("pallas", 4)])
def test_fused_step_no_recompiles_over_varied_sampling(model, backend, tp):
    """Temperatures, seeds, logprobs, penalties, batch sizes and prompt lengths all
    change values, never shapes (on one device, and sharded with each device reading
    its KV head by offset)."""
    llm = _engine(model, backend, tp, 1)
    warm = llm.num_compiles
    for n, (lo, hi), params in [
            (1, (3, 10), SamplingParams(max_tokens=4, temperature=0.7, seed=3)),
            (5, (30, 100), SamplingParams(max_tokens=3, logprobs=2, top_k=5)),
            (8, (3, 40), SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9,
                                        presence_penalty=0.5, ignore_eos=True)),
            (2, (1, 2), SamplingParams(max_tokens=6, repetition_penalty=1.2,
                                       min_p=0.1, ignore_eos=True))]:
        outs = llm.generate([{"prompt_token_ids": p}
                             for p in random_prompts(n, 128, lo, hi, seed=n)], params,
                            use_tqdm=False)
        assert len(outs) == n and all(o.outputs[0].token_ids for o in outs)
    assert llm.num_compiles == warm
