"""SamplingParams.prompt_logprobs through the Python API, against transformers.

For each prompt position i >= 1: the logprob of prompt token i given tokens < i, its
rank and the top k, position 0 None (vLLM's shape), matching transformers' log-softmax
of the same weights within 1e-3 — with chunked prefill forced (a prompt spans up to
five steps, so the last position of a chunk predicts the next chunk's first token), in
the layerwise and fused step forms, for n > 1, with prefix caching on and off (a
request that wants prompt logprobs takes no prefix hits) under evictions and
preemptions; no recompiles after warm-up.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine_utils import hf_model_from_weights, tiny_config, tiny_tokenizer, tiny_weights
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM
from jaxserve.sampling.params import RequestOutputKind

ATOL = 1e-3
# A 16-token step budget: prompts of up to 70 tokens take up to five chunks.
CHUNKED = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
               token_buckets=[4, 16])


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=5)
    return cfg, w, tiny_tokenizer(), hf_model_from_weights(cfg, w)


def reference(hf, prompt: list[int]) -> np.ndarray:
    """transformers' log-softmax over the prompt: row j predicts token j+1 ([L, V])."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def check(prompt: list[int], got: list, ref: np.ndarray, k: int) -> None:
    """got: RequestOutput.prompt_logprobs; ref: reference(); k: prompt_logprobs."""
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row, tok = got[i], ref[i - 1], prompt[i]
        # the prompt token, plus the top k (which may include it)
        assert tok in entry and len(entry) in (max(k, 1), k + 1), (i, entry)
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t]) < ATOL, (i, t, lp.logprob, row[t])
        # rank: tokens at least as likely (a near-tie in float32 may move it by one)
        assert abs(entry[tok].rank - int(np.sum(row >= row[tok]))) <= 1
        kth = np.sort(row)[-k] if k else np.inf
        assert all(row[t] >= kth - ATOL for t in entry if t != tok), (i, entry)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 128, n))) for n in lengths]


@pytest.mark.warmup
@pytest.mark.parametrize("step_mode", ["layerwise", "fused", "hybrid"])
def test_chunked_prefill_matches_transformers_without_recompiles(model, step_mode):
    cfg, w, tok, hf = model
    llm = LLM.from_weights(cfg, w, tok, step_mode=step_mode, **CHUNKED)
    warm = llm.num_compiles
    prompts = prompts_of([1, 2, 5, 16, 17, 37, 70])
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1,
                             prompt_logprobs=k) for k in (0, 1, 2, 3, 5, 0, 4)]
    # rows without prompt logprobs ride in the same steps
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:3]],
                        params + [plain] * 3, use_tqdm=False)
    for p, sp, o in zip(prompts, params, outs):
        check(p, o.prompt_logprobs, reference(hf, p), sp.prompt_logprobs)
        # the first output token's logprob continues the prompt's (the sampler's)
        ref_next = reference(hf, p + o.outputs[0].token_ids[:1])[len(p) - 1]
        first = o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob
        assert abs(first - ref_next[o.outputs[0].token_ids[0]]) < ATOL
    for o, twin in zip(outs[len(prompts):], outs):
        assert o.prompt_logprobs is None
        assert o.outputs[0].token_ids == twin.outputs[0].token_ids
    assert llm.num_compiles == warm, "prompt logprobs recompiled after warm-up"


def test_n_samples_share_one_prompt_logprobs(model):
    cfg, w, tok, hf = model
    llm = LLM.from_weights(cfg, w, tok, **CHUNKED)
    p = prompts_of([29], seed=1)[0]
    sp = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=11, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check(p, out.prompt_logprobs, reference(hf, p), 2)
    # streamed (DELTA) outputs carry them once, in the first output that has them
    llm.add_request({"prompt_token_ids": p}, replace(sp, output_kind=RequestOutputKind.DELTA))
    seen = []
    while llm.engine.has_unfinished_requests():
        outs, _ = llm.processor.process(llm.engine.step())
        seen += [o.prompt_logprobs for o in outs]
    carried = [x for x in seen if x is not None]
    assert len(seen) > 1 and len(carried) == 1 and seen[0] is not None
    assert carried[0] == out.prompt_logprobs


@pytest.mark.warmup
@pytest.mark.slow
def test_prefix_cache_on_off_identical_under_preemption(model):
    """Shared 40-token prefixes; every other request wants prompt logprobs. With the
    cache on, the others hit it and those never do (num_cached_tokens 0), and the
    prompt logprobs equal the cache-off run's and transformers'."""
    cfg, w, tok, hf = model
    rng = np.random.default_rng(2)
    systems = prompts_of([40, 40], seed=3)
    prompts = [systems[i % 2] + list(map(int, rng.integers(3, 128, int(rng.integers(1, 12)))))
               for i in range(12)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                             prompt_logprobs=2 if i % 2 else None) for i in range(12)]
    base = dict(max_model_len=128, max_num_seqs=6, max_num_batched_tokens=32,
                token_buckets=[8, 32], num_kv_blocks=14)
    runs = {}
    for on in (True, False):
        llm = LLM.from_weights(cfg, w, tok, enable_prefix_caching=on, **base)
        warm = llm.num_compiles
        runs[on] = []
        for _ in range(2):      # the second pass finds the first pass's prefixes
            runs[on].append(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                         use_tqdm=False))
        assert llm.num_compiles == warm
        if on:
            assert llm.engine.kv_manager.stats.hits > 0
            assert llm.engine.scheduler.num_preemptions > 0, "no request was preempted"
            cached = [o.num_cached_tokens for o in runs[on][1]]
            assert all(c == 0 for c in cached[1::2]) and any(c > 0 for c in cached[0::2])
    for on_outs, off_outs in zip(runs[True], runs[False]):
        for i, (a, b) in enumerate(zip(on_outs, off_outs)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            if i % 2 == 0:
                assert a.prompt_logprobs is None and b.prompt_logprobs is None
                continue
            check(prompts[i], a.prompt_logprobs, reference(hf, prompts[i]), 2)
            for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert ea.keys() == eb.keys()
                assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-5 for t in ea)
