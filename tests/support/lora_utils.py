"""Random LoRA adapters saved in the PEFT format, the transformers reference with an
adapter merged into its weights (W + scale * B @ A, what PEFT's merge does), and PEFT's
own LoRA model with several adapters as the unmerged reference."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxserve.model.config import ModelConfig
from jaxserve.model.lora import TARGETS, target_shapes

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
