"""Random LoRA adapters saved in the PEFT format; the transformers reference with an
adapter merged into its weights (W + scale * B @ A, what PEFT's merge does); PEFT's own
LoRA model with several adapters (the unmerged reference); and the check of an engine
against that model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from engine_utils import random_prompts
from jaxserve.lora import LoRARequest
from jaxserve.model.config import ModelConfig
from jaxserve.model.lora import TARGETS, target_shapes
from jaxserve.sampling.params import SamplingParams

HF_MODULE = {v: k for k, v in TARGETS.items()}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_adapter(path: Path, cfg: ModelConfig, *, rank: int, seed: int,
                 targets: tuple[str, ...] = ("q_proj", "v_proj"), alpha: float = 16.0,
                 rslora: bool = False, std: float = 0.3, dtype: Any = np.float32) -> Path:
    """A random adapter (A and B not zero) in PEFT's layout; returns its directory."""
    rng = np.random.default_rng(seed)
    shapes = target_shapes(cfg)
    tensors = {}
    for i in range(cfg.num_layers):
        for module in targets:
            fin, fout = shapes[TARGETS[module]]
            part = "self_attn" if module in ATTN else "mlp"
            pre = f"base_model.model.model.layers.{i}.{part}.{module}"
            tensors[f"{pre}.lora_A.weight"] = (rng.standard_normal((rank, fin)) * std).astype(dtype)
            tensors[f"{pre}.lora_B.weight"] = (rng.standard_normal((fout, rank)) * std).astype(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
        "target_modules": list(targets), "lora_dropout": 0.1, "bias": "none",
        "base_model_name_or_path": "tiny"}))
    return path


def merge_into(hf_model: Any, path: Path) -> Any:
    """hf_model (transformers, float32) with the adapter at path merged in, in place."""
    import torch
    from safetensors.numpy import load_file
    conf = json.loads((path / "adapter_config.json").read_text())
    r = conf["r"]
    scale = conf["lora_alpha"] / (np.sqrt(r) if conf.get("use_rslora") else r)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
            delta = scale * b.astype(np.float64) @ a.astype(np.float64)
            params[target].add_(torch.from_numpy(delta.astype(np.float32)))
    return hf_model


def peft_model(hf_model: Any, adapters: dict[str, Path]) -> Any:
    """PEFT's own LoRA model over hf_model (float32, eval mode) with every adapter of
    `adapters` (name -> PEFT directory) loaded: the reference that reads the files with
    PEFT's loader and applies each adapter as PEFT does (unmerged: x W + s x A B)."""
    from peft import PeftModel
    names = list(adapters)
    model = PeftModel.from_pretrained(hf_model, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


def peft_greedy(model: Any, prompt: list[int], n: int, adapter: str | None
                ) -> tuple[list[int], list[float]]:
    """n greedy tokens from a peft_model with one adapter (None: the base model), and
    each token's logprob (float64 log-softmax of the full-sequence logits)."""
    import torch
    name = "__base__" if adapter is None else adapter     # PEFT's name for "no adapter"
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids]), adapter_names=[name]).logits
            ids.append(int(logits[0, -1].argmax()))
        logits = model(input_ids=torch.tensor([ids]), adapter_names=[name]).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    toks = ids[len(prompt):]
    return toks, [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(toks)]


# The PEFT check (tests/engine/test_lora_peft.py; under TP=2 in tests/multidevice): three
# adapters of different ranks, target sets and scalings (rank, targets, rsLoRA; alpha 16
# each) and the base model, mixed in one batch.
PEFT_SPECS = [(8, ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"), False),
              (3, ("v_proj", "up_proj"), True),
              (5, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"), False)]
PEFT_ARGS = dict(enable_lora=True, max_loras=3, max_lora_rank=8, max_model_len=64,
                 max_num_seqs=4, token_buckets=[16], max_num_batched_tokens=16,
                 num_kv_blocks=32)


def check_against_peft(llm: Any, hf: Any, root: Path, vocab: int, std: float, seed: int,
                       n: int = 5) -> None:
    """The base model and PEFT_SPECS's adapters (saved under root, weights of scale
    std) in one batch of `llm`: each request's n greedy tokens equal peft_model's with
    that adapter active, logprobs within 1e-4; and the adapters change peft's tokens."""
    cfg = llm.model_config
    paths = {f"a{i}": save_adapter(root / f"a{i}", cfg, rank=r, seed=seed + i, targets=t,
                                   rslora=rs, std=std)
             for i, (r, t, rs) in enumerate(PEFT_SPECS)}
    prompts = random_prompts(4, vocab, 5, 11, seed=seed)
    which: list[str | None] = [None, "a0", "a1", "a2"]
    reqs = [None if name is None else LoRARequest(name, i, str(paths[name]))
            for i, name in enumerate(which)]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=reqs)
    ref = peft_model(hf, paths)
    for out, p, name in zip(outs, prompts, which):
        want, want_lp = peft_greedy(ref, p, n, name)
        got = out.outputs[0]
        assert got.token_ids == want, name
        lp = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(lp, want_lp, atol=1e-4, err_msg=str(name))
    # the adapters change the outputs: the comparison is not vacuous
    base = peft_greedy(ref, prompts[1], n, None)[0]
    assert any(peft_greedy(ref, prompts[1], n, name)[0] != base for name in paths)
