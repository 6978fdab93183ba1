"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors -> dequantized HF tensors.

llama.cpp's converter permutes the rows of Llama q/k weights (per head, it
interleaves the two rotate-half halves for its own RoPE kernel); we undo that so the
weights match HF's layout. Qwen2/Qwen3 GGUFs are not permuted.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from jaxserve.model.config import ModelConfig, UnsupportedModelError
from jaxserve.model.loader.assemble import assemble_weights, resolve_dtype
from jaxserve.model.loader.errors import CheckpointError

SUPPORTED_QUANTS = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises many types on truncated/corrupt input
        raise CheckpointError(f"{path}: not a valid GGUF file (truncated or corrupt: "
                              f"{type(e).__name__}: {str(e).strip()[:120]})") from e


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF name (unknown names pass through, and fail later)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = BLOCK_RE.match(gguf_name)
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_name


def gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: unsupported GGUF architecture {arch!r}; "
                                    f"supported: {sorted(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path}: GGUF rope_freqs (llama3 rope scaling baked into "
                                    f"a tensor) is not supported; load the HF checkpoint")

    def get(key: str, default: Any = None) -> Any:
        v = field(reader, f"{arch}.{key}", default)
        if v is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": int(vocab or 0),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    rope_type = field(reader, f"{arch}.rope.scaling.type")
    if rope_type not in (None, "none"):
        hf["rope_scaling"] = {"rope_type": rope_type,
                              "factor": float(get("rope.scaling.factor"))}
    return ModelConfig.from_hf_dict(hf)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute on [rows, ...] tensors."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def read_gguf(path: Path, dtype: str = "float32", progress: bool = True
              ) -> tuple[ModelConfig, dict[str, Any]]:
    """ModelConfig and weights (dequantized to `dtype`; 'auto' means float32)."""
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    tensors = {hf_name(t.name): t for t in reader.tensors}
    permute = {}
    if cfg.family in ("llama", "mistral"):
        for i in range(cfg.num_layers):
            for proj, n in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
                for kind in ("weight", "bias"):
                    permute[f"model.layers.{i}.self_attn.{proj}.{kind}"] = n

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        if t.tensor_type not in SUPPORTED_QUANTS:
            raise CheckpointError(f"{path}: tensor {t.name!r} uses unsupported GGUF type "
                                  f"{t.tensor_type.name}; supported: "
                                  f"{sorted(q.name for q in SUPPORTED_QUANTS)}")
        a = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        return unpermute_rows(a, permute[name]) if name in permute else a

    return cfg, assemble_weights(cfg, tensors.keys(), get, resolve_dtype(dtype, "float32"),
                                 str(path), progress)
