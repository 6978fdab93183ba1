"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors -> HF tensors, either
dequantized at load or kept quantized (`keep_quantized`, i.e. `--quantization gguf`):
Q8_0 / Q4_0 / Q4_1 / Q4_K matrices become model.quant.QArray leaves holding the file's
own bytes (split into values and scales, no dequantization); matrices in the other
quantized types are dequantized and stored as int8 per output channel (close to their
size, not bit-exact); float tensors stay float.

Gemma 2 / 3 (model/gemma.py): llama.cpp's converter stores every norm weight as 1 + w,
so 1 is taken off again (the decoder adds it back, as transformers does), and its norm
names differ from Llama's (`ffn_norm` is the pre-feed-forward norm).

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
from gguf.quants import Q4_K, dequantize

from jaxserve.model import gemma
from jaxserve.model.config import ModelConfig, UnsupportedModelError
from jaxserve.model.loader.assemble import assemble_weights, resolve_dtype
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.quant import QArray, quantize_matrix

SUPPORTED_QUANTS = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", **gemma.GGUF_ARCHITECTURES}
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


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name -> HF name (unknown names pass through, and fail later)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = BLOCK_RE.match(gguf_name)
    names = {**BLOCK_NAMES, **gemma.GGUF_NORMS} if arch in gemma.GGUF_ARCHITECTURES else BLOCK_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
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
    if arch in gemma.GGUF_ARCHITECTURES:
        hf.update(gemma.gguf_fields(arch, lambda k, d: field(reader, f"{arch}.{k}", d),
                                    hf["num_hidden_layers"], hidden, heads, hf["head_dim"]))
    return ModelConfig.from_hf_dict(hf)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute on [rows, ...] tensors."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


KEPT = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q4_K: "q4_k"}
BLOCK_BYTES = {Q.Q8_0: (32, 34), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q4_K: (256, 144)}


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def quantized_parts(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> dict[str, np.ndarray]:
    """A GGUF tensor's bytes [rows, bytes per row] -> QArray parts (views and small
    re-layouts of the same bytes; nothing is dequantized)."""
    per, size = BLOCK_BYTES[qtype]
    b = np.asarray(raw, np.uint8).reshape(rows, cols // per, size)
    if qtype == Q.Q8_0:
        return {"d": _f16(b[..., :2]), "q": np.ascontiguousarray(b[..., 2:]).view(np.int8)}
    if qtype == Q.Q4_0:
        return {"d": _f16(b[..., :2]), "p": np.ascontiguousarray(b[..., 2:])}
    if qtype == Q.Q4_1:
        return {"d": _f16(b[..., :2]), "m": _f16(b[..., 2:4]),
                "p": np.ascontiguousarray(b[..., 4:])}
    # Q4_K super-block: d, dmin (f16), 12 bytes of packed 6-bit sub-block scales/mins,
    # 128 bytes of 4-bit values (4 groups of 64). The 6-bit fields are unpacked to one
    # byte each (16 instead of 12 bytes per 256 values) so the step needs no bit games.
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    return {"d": _f16(b[..., :2]), "dmin": _f16(b[..., 2:4]),
            "sc": sc.reshape(rows, -1).astype(np.uint8),
            "mn": mn.reshape(rows, -1).astype(np.uint8),
            "p": np.ascontiguousarray(b[..., 16:]).reshape(rows, -1, 32)}


def _kept(t: Any, dtype: Any) -> QArray | None:
    """The tensor as a QArray when it is a matrix this loader keeps quantized."""
    if len(t.shape) != 2:
        return None
    cols, rows = (int(d) for d in t.shape)          # ggml lists the fastest axis first
    if t.tensor_type in KEPT:
        return QArray(KEPT[t.tensor_type], quantized_parts(t.data, t.tensor_type, rows, cols),
                      (rows, cols), dtype)
    if t.tensor_type in (Q.F32, Q.F16, Q.BF16):
        return None
    m = dequantize(t.data, t.tensor_type).reshape(rows, cols)
    return quantize_matrix(m, "int8", dtype)


def read_gguf(path: Path, dtype: str = "float32", progress: bool = True,
              keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """ModelConfig and weights: dequantized to `dtype` ('auto' means float32), or with
    keep_quantized its quantized matrices as QArrays that dequantize to `dtype`."""
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    arch = field(reader, "general.architecture")
    tensors = {hf_name(t.name, arch): t for t in reader.tensors}
    permute = {}
    if cfg.family in ("llama", "mistral"):
        for i in range(cfg.num_layers):
            for proj, n in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
                for kind in ("weight", "bias"):
                    permute[f"model.layers.{i}.self_attn.{proj}.{kind}"] = n

    jdtype = resolve_dtype(dtype, "float32")

    def get(name: str) -> np.ndarray | QArray:
        t = tensors[name]
        if t.tensor_type not in SUPPORTED_QUANTS:
            raise CheckpointError(f"{path}: tensor {t.name!r} uses unsupported GGUF type "
                                  f"{t.tensor_type.name}; supported: "
                                  f"{sorted(q.name for q in SUPPORTED_QUANTS)}")
        q = _kept(t, jdtype) if keep_quantized else None
        if q is not None:
            return q.map_parts(lambda _, p: unpermute_rows(p, permute[name])
                               if name in permute else p)
        a = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if cfg.norm_offset and name.endswith("norm.weight"):
            a = a.astype(np.float32) - cfg.norm_offset   # llama.cpp stores Gemma's 1 + w
        return unpermute_rows(a, permute[name]) if name in permute else a

    return cfg, assemble_weights(cfg, tensors.keys(), get, jdtype, str(path), progress)
