"""Engine core end to end on a tiny random Llama: batching, chunked prefill, preemption,
zero recompiles, admission errors. The truth is each prompt run alone and transformers."""
from __future__ import annotations

import pytest

from engine_utils import (hf_greedy, hf_model_from_weights, random_prompts, tiny_config,
                          tiny_tokenizer, tiny_weights)
from jaxserve import SamplingParams
from jaxserve.config import ConfigError, EngineArgs

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SMALL = dict(max_model_len=128, max_num_seqs=16, token_buckets=[16, 64])


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_weights(cfg), tiny_tokenizer()


def _make(tiny_llm, **kw):
    """The session's engine on the tiny model (the `model` fixture's weights) with these
    arguments: tests with equal arguments share one (tests/support/engine_pool.py)."""
    args = dict(SMALL, max_num_batched_tokens=64)
    args.update(kw)
    return tiny_llm(**args)


def _greedy(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(32, 128, 3, 100, seed=1)


@pytest.fixture(scope="module")
def reference(model, prompts):
    cfg, w, _ = model
    hf = hf_model_from_weights(cfg, w)
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_batched_equals_alone_and_transformers(tiny_llm_factory, prompts, reference, backend):
    llm = _make(tiny_llm_factory, attention_backend=backend)
    batched = _greedy(llm, prompts)
    assert batched == reference
    for i in (0, 7, 31):
        assert _greedy(llm, [prompts[i]]) == [reference[i]]


@pytest.mark.parametrize("backend,pipeline", [("cpu", True), ("reference", False)])
@pytest.mark.slow
def test_chunked_prefill_and_preemption_keep_outputs(tiny_llm_factory, prompts, reference,
                                                     backend, pipeline, monkeypatch):
    # 24-token budget: every prompt over 24 tokens is split; 24 blocks of 16 tokens cannot
    # hold 16 running sequences, so the scheduler must preempt.
    llm = _make(tiny_llm_factory, max_num_batched_tokens=24, token_buckets=[8, 24],
                num_kv_blocks=24, attention_backend=backend, pipeline_steps=pipeline)
    seen_chunked = []
    orig = llm.engine.scheduler.schedule

    def spy():
        so = orig()
        for new in so.scheduled_new_reqs:
            if so.num_scheduled_tokens[new.req_id] + new.num_computed_tokens < len(new.token_ids):
                seen_chunked.append(new.req_id)
        return so
    monkeypatch.setattr(llm.engine.scheduler, "schedule", spy)
    preempted = llm.engine.scheduler.num_preemptions     # a shared engine counts on
    assert _greedy(llm, prompts) == reference
    assert seen_chunked, "no prompt was chunked"
    assert llm.engine.scheduler.num_preemptions > preempted, "no request was preempted"
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


@pytest.mark.warmup
def test_no_recompiles_after_warmup(tiny_llm_factory):
    llm = _make(tiny_llm_factory)
    warm = llm.num_compiles
    assert warm >= len(llm.engine.buckets.all_shapes())
    for n, (lo, hi), mt in [(1, (3, 10), 5), (5, (50, 110), 3), (16, (3, 60), 9), (3, (1, 2), 20)]:
        _greedy(llm, random_prompts(n, 128, lo, hi, seed=n), SamplingParams(
            max_tokens=mt, temperature=0.7, seed=3, ignore_eos=True))
    assert llm.num_compiles == warm


def test_request_that_cannot_fit_is_rejected_others_continue(tiny_llm_factory, prompts,
                                                             reference):
    llm = _make(tiny_llm_factory)
    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
        llm.generate({"prompt_token_ids": list(range(3, 120))},
                     SamplingParams(max_tokens=50), use_tqdm=False)
    assert _greedy(llm, prompts[:4]) == reference[:4]


def test_eos_and_stop_token_ids_finish(tiny_llm_factory, prompts, reference):
    llm = _make(tiny_llm_factory)
    target = reference[0][3]
    out = llm.generate({"prompt_token_ids": prompts[0]},
                       SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    cut = reference[0].index(target)
    assert out.token_ids == reference[0][:cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


@pytest.mark.parametrize("bad, match", [
    (dict(block_size=0), "block_size"),
    (dict(max_num_batched_tokens=8, block_size=16), "max_num_batched_tokens"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(dtype="float16"), "dtype"),
])
def test_invalid_engine_settings(bad, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(**bad)


def test_seeded_sampling_unchanged_by_batching_and_preemption(tiny_llm_factory, prompts):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    roomy = _make(tiny_llm_factory)
    alone = [_greedy(roomy, [p], params)[0] for p in prompts[:6]]
    tight = _make(tiny_llm_factory, max_num_batched_tokens=24, token_buckets=[8, 24],
                  num_kv_blocks=14)
    preempted = tight.engine.scheduler.num_preemptions
    assert _greedy(tight, prompts, params)[:6] == alone
    assert tight.engine.scheduler.num_preemptions > preempted
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    a, b = _greedy(roomy, [prompts[0]] * 2, unseeded)
    assert a != b, "unseeded requests should differ"


@pytest.mark.slow   # the Pallas kernel interpreted on CPU: minutes on 2 cores
def test_pallas_backend_matches_reference_end_to_end(tiny_llm_factory, prompts, reference):
    # The Pallas kernel runs interpreted on CPU, every step slowly: short prompts (33, 12,
    # 9 and 14 tokens) in 32-token steps still give prefill chunks with context (the
    # first and the last prompt are split) beside decodes.
    llm = _make(tiny_llm_factory, attention_backend="pallas", max_num_batched_tokens=32,
                token_buckets=[32], max_num_seqs=4, num_kv_blocks=64)
    pick = (4, 1, 11, 2)
    assert [len(prompts[i]) for i in pick] == [33, 12, 9, 14]
    out = _greedy(llm, [prompts[i] for i in pick],
                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert out == [reference[i][:6] for i in pick]


def test_pipelined_steps_equal_synchronous_ones_and_free_everything(tiny_llm_factory,
                                                                    prompts):
    """Pipelining (dispatch N+1 before N's outputs are processed) delays the finishes the
    output processor decides (stop strings) by one step: outputs must not change, the
    extra tokens must be dropped, and every block must come back."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True,
                            stop=["w7"])
    outs = {}
    for pipeline in (True, False):
        # pipelining is the default: the engine of the tests above, not one more
        llm = _make(tiny_llm_factory, **({} if pipeline else dict(pipeline_steps=False)))
        assert llm.args.pipeline_steps == pipeline
        overlapped = llm.engine.stats.overlapped_seconds
        res = llm.generate([{"prompt_token_ids": p} for p in prompts[:16]], params,
                           use_tqdm=False)
        outs[pipeline] = [(o.outputs[0].token_ids, o.outputs[0].text,
                           o.outputs[0].finish_reason) for o in res]
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
        assert not llm.engine.has_unfinished_requests()
        if pipeline:
            assert llm.engine.stats.overlapped_seconds > overlapped
    assert outs[True] == outs[False]
    assert any(reason == "stop" for _, _, reason in outs[True]), "no stop string was hit"
