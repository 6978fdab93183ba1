"""LLM.embed with a LoRA adapter: each prompt's embedding equals the one of an engine
whose weights have the adapter merged in (W + scale * A^T B^T in jaxserve's [in, out]
layout), and differs from the base model's; base prompts in the same call are
unchanged."""
from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import load_file

from engine_pool import tiny_model
from engine_utils import random_prompts
from lora_utils import save_adapter
from jaxserve.frontend.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.model.lora import TARGETS

ARGS = dict(task="embed", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
            token_buckets=[32])


def _merged(w, path, num_layers):
    conf = json.loads((path / "adapter_config.json").read_text())
    scale = conf["lora_alpha"] / conf["r"]
    t = load_file(str(path / "adapter_model.safetensors"))
    layers = [dict(layer) for layer in w["layers"]]
    for i in range(num_layers):
        for name, key in TARGETS.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{i}.{part}.{name}"
            if f"{pre}.lora_A.weight" in t:
                a, b = t[f"{pre}.lora_A.weight"], t[f"{pre}.lora_B.weight"]
                layers[i][key] = np.asarray(layers[i][key]) + scale * (a.T @ b.T)
    return {**w, "layers": layers}


def test_embed_with_adapter_equals_merged_weights(tmp_path):
    cfg, w, tok = tiny_model()
    path = save_adapter(tmp_path / "a", cfg, rank=4, seed=3, std=0.2,
                        targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    req = LoRARequest("a", 1, str(path))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 128, 5, 20, seed=2)]
    llm = LLM.from_weights(cfg, w, tok, enable_lora=True, max_loras=1, max_lora_rank=4,
                           **ARGS)
    got = llm.embed(prompts, use_tqdm=False, lora_request=[req, None, req])
    base = llm.embed(prompts, use_tqdm=False)
    merged = LLM.from_weights(cfg, _merged(w, path, cfg.num_layers), tok, **ARGS).embed(
        prompts, use_tqdm=False)
    for i in (0, 2):
        np.testing.assert_allclose(got[i], merged[i], rtol=1e-4, atol=1e-5)
        assert not np.allclose(got[i], base[i], atol=1e-3)
    np.testing.assert_allclose(got[1], base[1], rtol=1e-6, atol=1e-7)
