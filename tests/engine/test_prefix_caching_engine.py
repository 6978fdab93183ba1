"""Prefix caching end to end: outputs identical with the cache on and off (greedy and
seeded sampling), under heavy sharing, evictions and preemptions; cache_salt isolation."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM

BASE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[8, 32])
SEED = 3      # the tiny model's weights


def shared_prompts(n: int = 24, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    systems = [list(map(int, rng.integers(3, 128, 40))) for _ in range(3)]
    out = []
    for i in range(n):
        turn = list(map(int, rng.integers(3, 128, int(rng.integers(1, 20)))))
        out.append(systems[i % 3] + turn)
    return out


def run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
], ids=["greedy", "seeded"])
@pytest.mark.slow
def test_cache_on_off_identical_with_evictions_and_preemptions(tiny_llm_factory, params):
    prompts = shared_prompts()
    # 20 blocks x 16 tokens: far too few to keep every prefix (evictions) and, with 8
    # running sequences of up to ~70 tokens, too few to run them all (preemptions).
    on = tiny_llm_factory(seed=SEED, num_kv_blocks=20, enable_prefix_caching=True, **BASE)
    off = tiny_llm_factory(seed=SEED, num_kv_blocks=20, enable_prefix_caching=False, **BASE)
    # the engines are shared: their counters are read as differences
    hits, evictions = on.engine.kv_manager.stats.hits, on.engine.kv_manager.pool.num_evictions
    preemptions = on.engine.scheduler.num_preemptions
    # Two passes: the second finds prefixes the first one left behind (or evicted).
    for _ in range(2):
        assert run(on, prompts, params) == run(off, prompts, params)
    stats = on.engine.kv_manager.stats
    assert stats.hits > hits, "the workload never hit the prefix cache"
    assert on.engine.kv_manager.pool.num_evictions > evictions, "no cached block was evicted"
    assert on.engine.scheduler.num_preemptions > preemptions, "no request was preempted"
    assert off.engine.kv_manager.stats.hits == 0
    for llm in (on, off):
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_cache_salt_isolates_tenants(tiny_llm_factory):
    llm = tiny_llm_factory(seed=SEED, num_kv_blocks=64, **BASE)
    prompt = shared_prompts(1)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.add_request({"prompt_token_ids": prompt}, params, cache_salt="tenant-a")
    llm._run([], use_tqdm=False)
    hits0 = llm.engine.kv_manager.stats.hits
    llm.add_request({"prompt_token_ids": prompt}, params, cache_salt="tenant-b")
    llm._run([], use_tqdm=False)
    assert llm.engine.kv_manager.stats.hits == hits0, "another tenant's blocks were reused"
    llm.add_request({"prompt_token_ids": prompt}, params, cache_salt="tenant-a")
    llm._run([], use_tqdm=False)
    assert llm.engine.kv_manager.stats.hits > hits0, "the same tenant did not hit its prefix"


def test_reset_prefix_cache(tiny_llm_factory):
    llm = tiny_llm_factory(seed=SEED, num_kv_blocks=64, **BASE)
    p = shared_prompts(2)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    run(llm, p[:1], params)
    assert llm.reset_prefix_cache()
    h = llm.engine.kv_manager.stats.hits
    run(llm, p[:1], params)
    assert llm.engine.kv_manager.stats.hits == h
