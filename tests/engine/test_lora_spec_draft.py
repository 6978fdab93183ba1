"""Device drafters with LoRA adapters: a mixed batch (two adapters and the base model)
gives the same greedy tokens with `self` and `draft_model` speculation as without; the
`self` draft runs each row's own adapter (its slot in the draft steps), a draft model
the base."""
from __future__ import annotations

import dataclasses

import pytest

from engine_utils import random_prompts
from lora_utils import save_adapter
from spec_utils import drafting_target, save_checkpoint
from jaxserve.frontend.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=4, max_model_len=128,
            max_num_seqs=16, max_num_batched_tokens=32, token_buckets=[8, 32])
# max_num_seqs above the 4 requests: a step keeps logit rows for proposals
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg, w, tok = drafting_target()
    root = tmp_path_factory.mktemp("lora_draft")
    reqs = [LoRARequest(f"a{i}", i + 1, str(save_adapter(root / f"a{i}", cfg, rank=4,
                                                         seed=20 + i, targets=ALL, std=0.2)))
            for i in range(2)]
    draft = save_checkpoint(dataclasses.replace(cfg, num_layers=2),
                            {**w, "layers": w["layers"][:2]}, tok, root / "draft")
    prompts = random_prompts(4, 128, 4, 20, seed=5)
    loras = [reqs[0], None, reqs[1], reqs[0]]
    plain = LLM.from_weights(cfg, w, tok, **ARGS)
    ref, base = _run(plain, prompts, loras), _run(plain, prompts, [None] * 4)
    assert ref[0] != base[0] and ref[2] != base[2]          # the adapters change tokens
    return cfg, w, tok, draft, prompts, loras, ref


def _run(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.warmup
@pytest.mark.parametrize("method", ["self", "draft_model"])
def test_greedy_identical_with_speculation(setup, method, monkeypatch):
    cfg, w, tok, draft, prompts, loras, ref = setup
    spec = ({"method": "self", "draft_num_layers": 2, "num_speculative_tokens": 3}
            if method == "self" else
            {"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    llm = LLM.from_weights(cfg, w, tok, speculative_config=spec, **ARGS)
    drafter = llm.engine.runner.drafter
    seen = []
    run = drafter._run
    monkeypatch.setattr(drafter, "_run", lambda packed: (
        seen.append(packed.unpack("draft")[1].lora_slots), run(packed))[1])
    warm = llm.num_compiles
    assert _run(llm, prompts, loras) == ref
    assert llm.num_compiles == warm
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    if method == "self":        # adapter rows draft in their slots, the base row in 0
        assert any(int(s.max()) > 0 for s in seen)
    else:
        assert all(s is None for s in seen)
