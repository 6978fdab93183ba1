"""LoRA against PEFT itself: three random adapters (B not zero, different ranks, target
sets and scalings) and the base model mixed in one batch of the engine, each request's
greedy tokens identical to transformers + peft's PeftModel with that adapter active
(peft's loader reads the same files; unmerged, its own LoRA layers), logprobs within
1e-4: on a tiny random Qwen3 checkpoint (q/k norms, head_dim 24: q_proj 64 -> 96) and
on the default model (SmolLM2-135M)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("peft")

from engine_utils import hf_model_from_weights, random_prompts     # noqa: E402
from lora_utils import peft_greedy, peft_model, save_adapter         # noqa: E402
from jaxserve.frontend.llm import LLM                                # noqa: E402
from jaxserve.lora import LoRARequest                                # noqa: E402
from jaxserve.sampling.params import SamplingParams                  # noqa: E402

N = 5
PARAMS = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0)
# (rank, targets, rsLoRA): different ranks and target sets, alpha 16 each
SPECS = [(8, ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"), False),
         (3, ("v_proj", "up_proj"), True),
         (5, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
          False)]
ARGS = dict(enable_lora=True, max_loras=3, max_lora_rank=8, max_model_len=64,
            max_num_seqs=4, token_buckets=[16], max_num_batched_tokens=16, num_kv_blocks=32)


def _check(llm: LLM, hf: Any, root: Path, vocab: int, std: float, seed: int) -> None:
    cfg = llm.model_config
    paths = {f"a{i}": save_adapter(root / f"a{i}", cfg, rank=r, seed=seed + i, targets=t,
                                   rslora=rs, std=std)
             for i, (r, t, rs) in enumerate(SPECS)}
    prompts = random_prompts(4, vocab, 5, 11, seed=seed)
    which: list[str | None] = [None, "a0", "a1", "a2"]
    reqs = [None if n is None else LoRARequest(n, i, str(paths[n]))
            for i, n in enumerate(which)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                        lora_request=reqs)
    ref = peft_model(hf, paths)
    for out, p, name in zip(outs, prompts, which):
        want, want_lp = peft_greedy(ref, p, N, name)
        got = out.outputs[0]
        assert got.token_ids == want, name
        lp = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(lp, want_lp, atol=1e-4, err_msg=str(name))
    # the adapters change the outputs: the comparison is not vacuous
    base = peft_greedy(ref, prompts[1], N, None)[0]
    assert any(peft_greedy(ref, prompts[1], N, n)[0] != base for n in paths)


@pytest.mark.slow     # its own engine (~40 s with a cold compile cache; test_lora.py
                      # checks peft fast)
def test_qwen3_checkpoint_matches_peft(tmp_path):
    from model_utils import make_hf_model, save_hf_model
    save_hf_model("qwen3_qknorm_headdim24", tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), **ARGS)
    _check(llm, make_hf_model("qwen3_qknorm_headdim24"), tmp_path, 128, 0.3, 30)


@pytest.mark.slow     # the 135M model in the engine and in torch (2-4 min on 2 cores)
def test_default_model_matches_peft(default_model, tmp_path):
    m = default_model
    llm = LLM.from_weights(m.config, m.weights, m.tokenizer, **ARGS)
    hf = hf_model_from_weights(m.config, m.weights).eval()
    _check(llm, hf, tmp_path, m.config.vocab_size, 0.05, 40)
