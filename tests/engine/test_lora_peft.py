"""LoRA against PEFT itself: three random adapters (B not zero, different ranks, target
sets and scalings) and the base model mixed in one batch of the engine, each request's
greedy tokens identical to transformers + peft's PeftModel with that adapter active
(peft's loader reads the same files; unmerged, its own LoRA layers), logprobs within
1e-4: on a tiny random Qwen3 checkpoint (q/k norms, head_dim 24: q_proj 64 -> 96) and
on the default model (SmolLM2-135M). tests/multidevice/test_lora_sharded.py runs the
same checks under TP=2."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")

from engine_utils import hf_model_from_weights                      # noqa: E402
from lora_utils import PEFT_ARGS, check_against_peft                 # noqa: E402
from jaxserve.frontend.llm import LLM                                # noqa: E402


@pytest.mark.slow     # its own engine (~40 s with a cold compile cache; test_lora.py
                      # checks peft fast)
def test_qwen3_checkpoint_matches_peft(tmp_path):
    from model_utils import make_hf_model, save_hf_model
    save_hf_model("qwen3_qknorm_headdim24", tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), **PEFT_ARGS)
    check_against_peft(llm, make_hf_model("qwen3_qknorm_headdim24"), tmp_path, 128, 0.3, 30)


@pytest.mark.slow     # the 135M model in the engine and in torch (2-4 min on 2 cores)
def test_default_model_matches_peft(default_model, tmp_path):
    m = default_model
    llm = LLM.from_weights(m.config, m.weights, m.tokenizer, **PEFT_ARGS)
    hf = hf_model_from_weights(m.config, m.weights).eval()
    check_against_peft(llm, hf, tmp_path, m.config.vocab_size, 0.05, 40)
