"""A tiny random Qwen3 checkpoint saved as a sentence-transformers embedding model, and
the transformers reference for its embeddings.

The checkpoint is an ordinary Hugging Face directory (config.json, safetensors, a
word-level tokenizer) plus sentence-transformers' modules.json and 1_Pooling/config.json,
so jaxserve's loader reads it as any Qwen3 checkpoint and the engine finds its pooling
(model/pooling.py) from the directory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from engine_utils import hf_model_from_weights, tiny_config, tiny_tokenizer, tiny_weights


def qwen3_config() -> Any:
    return tiny_config(architecture="Qwen3ForCausalLM", family="qwen3", qk_norm=True,
                       max_position_embeddings=256)


def save_embedding_checkpoint(out: Path, pooling: str = "lasttoken",
                              normalize: bool = True, seed: int = 3) -> Path:
    """The tiny Qwen3 model as a sentence-transformers checkpoint in `out`."""
    cfg = qwen3_config()
    model = hf_model_from_weights(cfg, tiny_weights(cfg, seed=seed))
    model.save_pretrained(out)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": cfg.hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "lasttoken"}))
    return out


def reference_embeddings(model_dir: Path, prompts: list[list[int]], pooling: str,
                         normalize: bool = True) -> list[np.ndarray]:
    """transformers' AutoModel (no LM head) final hidden states, pooled (last token or
    mean over the prompt) and optionally normalised, one prompt at a time."""
    import torch
    import transformers
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            h = model(torch.tensor([p])).last_hidden_state[0].double().numpy()
            v = h[-1] if pooling == "last" else h.mean(axis=0)
            out.append(v / np.linalg.norm(v) if normalize else v)
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
