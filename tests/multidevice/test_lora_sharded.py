"""LoRA adapters under tensor parallelism (TP=2 on simulated devices): each slot array is
split like the projection it adapts (column-parallel q/k/v/gate/up: B on its outputs;
row-parallel o/down: A on its inputs), and a mixed batch (base + two adapters, fused
8-token and layerwise 32-token steps) gives the one-device engine's greedy tokens, with
the masked delta and with the grouped-by-slot one; and three adapters with the base
model in one batch give transformers + peft's tokens and logprobs."""
from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from engine_utils import (hf_model_from_weights, random_prompts, tiny_config, tiny_tokenizer,
                          tiny_weights)
from lora_utils import PEFT_ARGS, check_against_peft, save_adapter
from model_utils import make_hf_model, save_hf_model
from jaxserve.frontend.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.model import lora as lora_model
from jaxserve.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
            max_num_seqs=8, token_buckets=[8, 32], max_num_batched_tokens=32)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _run(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = tiny_config()                 # 4 query heads, 2 KV heads: attention splits at TP=2
    w, tok = tiny_weights(cfg), tiny_tokenizer()
    root = tmp_path_factory.mktemp("adapters")
    paths = [save_adapter(root / "a0", cfg, rank=8, seed=1, targets=ALL),
             save_adapter(root / "a1", cfg, rank=4, seed=2, targets=("q_proj", "o_proj",
                                                                      "down_proj"))]
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    prompts = random_prompts(4, 128, 5, 20, seed=3) + random_prompts(1, 128, 40, 40, seed=4)
    loras = [None, reqs[0], reqs[1], reqs[0], None]
    # compiles only the shapes its steps use: the one-device engine's compiles are not
    # counted
    one = LLM.from_weights(cfg, w, tok, **ARGS, warmup=False)
    want = _run(one, prompts, loras)
    base = _run(one, prompts, [None] * len(prompts))
    assert want[1] != base[1] and want[2] != base[2]        # the adapters change tokens
    return cfg, w, tok, prompts, loras, want


@pytest.mark.warmup
@pytest.mark.parametrize("grouped", [False, True], ids=["masked", "grouped"])
def test_tp2_mixed_batch_equals_one_device(setup, monkeypatch, grouped):
    """grouped: the TP=2 engine takes the grouped-by-slot delta for every step above 8
    tokens (the one-device reference the masked one)."""
    cfg, w, tok, prompts, loras, want = setup
    if grouped:
        monkeypatch.setattr(lora_model, "BLOCKED_MIN_SAVING", 0)
        assert lora_model.form(32, 3) == "blocked"
    two = LLM.from_weights(cfg, w, tok, tensor_parallel_size=2, **ARGS)
    layer = two.engine.runner.weights["layers"][0]["lora"]
    assert layer["wq"]["a"].sharding.spec == P(None, None, None)
    assert layer["wq"]["b"].sharding.spec == P(None, None, "model")
    assert layer["wo"]["a"].sharding.spec == P("model", None, None)
    assert layer["wo"]["b"].sharding.spec == P(None, None, None)
    assert layer["w_down"]["a"].sharding.spec == P("model", None, None)
    assert layer["w_up"]["b"].sharding.spec == P(None, None, "model")
    warm = two.num_compiles
    assert _run(two, prompts, loras) == want
    assert two.num_compiles == warm
    slots = two.engine.runner.weights["layers"][0]["lora"]
    assert slots["wo"]["a"].sharding.spec == P("model", None, None)   # the write keeps it


# ---- the same against transformers + peft under TP=2 ---------------------------------
@pytest.mark.parametrize("model", ["qwen3", "nine_heads"])
def test_tp2_mixed_batch_matches_peft(model, tmp_path):
    """tests/engine/test_lora_peft.py's check (three adapters and the base model in one
    batch: greedy tokens equal peft's, logprobs within 1e-4) on a TP=2 engine: a tiny
    random Qwen3 checkpoint (4 query / 2 KV heads, head_dim 24) and a tiny Llama with
    the default model's attention geometry (9 query / 3 KV heads do not split over 2
    devices: attention and its adapters stay whole while the MLP and the vocabulary
    split). The plan splits it as it splits SmolLM2-135M, whose 30 real layers add
    nothing to the comparison."""
    pytest.importorskip("peft")
    if model == "qwen3":
        save_hf_model("qwen3_qknorm_headdim24", tmp_path / "m")
        llm = LLM(str(tmp_path / "m"), tensor_parallel_size=2, **PEFT_ARGS)
        check_against_peft(llm, make_hf_model("qwen3_qknorm_headdim24"), tmp_path, 128,
                           0.3, 30)
    else:
        cfg = tiny_config(num_heads=9, num_kv_heads=3, head_dim=8, hidden_size=72,
                          intermediate_size=96, vocab_size=960, tie_word_embeddings=True)
        w = tiny_weights(cfg)
        llm = LLM.from_weights(cfg, w, tiny_tokenizer(cfg.vocab_size),
                               tensor_parallel_size=2, **PEFT_ARGS)
        decisions = llm.engine.runner.plan.decisions
        assert not decisions["heads"].sharded and decisions["ffn"].sharded
        check_against_peft(llm, hf_model_from_weights(cfg, w).eval(), tmp_path,
                           cfg.vocab_size, 0.3, 40)
    assert llm.engine.runner.plan is not None and llm.engine.runner.plan.mesh.size == 2
