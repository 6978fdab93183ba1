"""Device drafters under tensor parallelism (8 simulated CPU devices, TP = 2): greedy
outputs equal the one-device engine without speculation; a draft model is placed on the
target's mesh with its own plan (its KV split over the devices like the target's, or one
copy per rank where TP exceeds its KV heads); no recompiles after warm-up.
"""
from __future__ import annotations

import dataclasses

import pytest

from engine_utils import random_prompts, tiny_config, tiny_weights
from spec_utils import drafting_target, save_checkpoint
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM


# 128 tokens hold the longest request (40 + 16) with room for proposals, and make the
# block-table widths 0 and 8 (8 blocks of 16); 8 rows hold the 6 requests: each warm-up
# compiles 2 x 2 step shapes and one proposal shape (8 rows x 8 blocks)
SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
             token_buckets=[8, 32])
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return drafting_target()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 128, 3, 40, seed=3)


def _run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(model, prompts):
    cfg, w, tok = model
    # compiles only the shapes its steps use: the one-device engine's compiles are not
    # counted
    return _run(LLM.from_weights(cfg, w, tok, **SMALL, warmup=False), prompts)


def _check(llm, prompts, reference):
    warm = llm.num_compiles
    assert _run(llm, prompts) == reference
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert llm.num_compiles == warm


@pytest.mark.warmup
def test_self_under_tp2(model, prompts, reference):
    cfg, w, tok = model
    llm = LLM.from_weights(cfg, w, tok, **SMALL, tensor_parallel_size=2,
                           speculative_config={"method": "self", "draft_num_layers": 2,
                                               "num_speculative_tokens": 3})
    _check(llm, prompts, reference)


@pytest.mark.warmup
@pytest.mark.parametrize("geometry", ["target_layers", "one_kv_head"])
def test_draft_model_under_tp2(model, prompts, reference, tmp_path, geometry):
    cfg, w, tok = model
    if geometry == "target_layers":     # the target's first two layers
        dcfg, dw = dataclasses.replace(cfg, num_layers=2), {**w, "layers": w["layers"][:2]}
    else:                               # one KV head: a copy per rank (TP 2 > 1)
        dcfg = tiny_config(num_layers=1, hidden_size=32, intermediate_size=64,
                           num_heads=4, num_kv_heads=1, head_dim=8)
        dw = tiny_weights(dcfg, seed=7)
    path = save_checkpoint(dcfg, dw, tok, tmp_path / geometry)
    llm = LLM.from_weights(cfg, w, tok, **SMALL, tensor_parallel_size=2,
                           speculative_config={"method": "draft_model", "model": path,
                                               "num_speculative_tokens": 3})
    if geometry == "target_layers":
        _check(llm, prompts, reference)
    else:           # a random draft is rarely right: exactness and no recompiles
        warm = llm.num_compiles
        assert _run(llm, prompts) == reference
        assert llm.num_compiles == warm
    draft = llm.engine.runner.drafter.model
    assert draft.cfg.kv_head_replicas == (1 if geometry == "target_layers" else 2)
    k_pool = draft.kv[0][0]
    assert k_pool.shape[0] == 2              # 2 KV heads, or 1 head x 2 copies
    shard_heads = {s.data.shape[0] for s in k_pool.addressable_shards}
    assert shard_heads == {1}, "the draft's KV heads are split over the TP ranks"
