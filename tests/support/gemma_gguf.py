"""Tiny Gemma 2 / Gemma 3 GGUF files written the way llama.cpp's converter writes them.

Follows convert_hf_to_gguf.py (conversion/gemma.py: Gemma2Model, Gemma3Model, on top of
TextModel.set_gguf_parameters) with --outtype f32, step for step:

* metadata: Gemma 2 writes context/embedding/feed-forward length, block count, head
  counts, rms eps, key/value length, both soft-caps and the sliding window (no RoPE
  base: llama.cpp's default 10000); Gemma 3 adds the full-attention RoPE base (and linear
  scaling), the sliding layers' base (`rope.freq_base_swa`), the final soft-cap when set
  and the sliding window;
* tensors: HF names through gguf's tensor map (Gemma's `ffn_norm` is the pre-feed-forward
  norm, `post_attention_norm`, `post_ffw_norm`), every `*norm.weight` stored as 1 + w,
  Gemma 2's lm_head dropped, Gemma 3's embedding cut to the tokenizer's size, no q/k
  permutation (Gemma uses NeoX-style RoPE in llama.cpp);
* vocabulary: the tokenizer's tokens as a "gpt2" model (the converter's path for a
  tokenizer.json without tokenizer.model; the pre-tokenizer is named "default" since a
  character-level test tokenizer has no registered hash).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in GLOBAL:
        return GLOBAL[name]
    i, rest = name[len("model.layers."):].split(".", 1)
    mod, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{BLOCK[mod]}.{kind}"


def _metadata(w: Any, arch: str, c: Any) -> None:
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(0)                                   # ALL_F32
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        return
    full = c.rope_parameters["full_attention"]
    if full.get("rope_type") == "linear":
        import gguf
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)


def _vocab(w: Any, tokenizer: Any, vocab_size: int) -> None:
    import gguf
    inv = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([inv.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       if i in inv else gguf.TokenType.UNUSED for i in range(vocab_size)])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)


def write_gemma_gguf(path: Path, model: Any, tokenizer: Any) -> dict[str, np.ndarray]:
    """Write `model` (Gemma2ForCausalLM / Gemma3ForCausalLM) to path; returns the tensors
    written, by GGUF name."""
    import gguf

    c = model.config
    arch = "gemma2" if c.model_type == "gemma2" else "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, c)
    _vocab(w, tokenizer, c.vocab_size)
    n_vocab_real = len(tokenizer.get_vocab())
    written = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and (arch == "gemma2" or c.tie_word_embeddings):
            continue
        a = t.float().numpy()
        if name.endswith("norm.weight"):
            a = a + 1.0                                    # Gemma RMSNorm's (1 + w)
        if arch == "gemma3" and name == "model.embed_tokens.weight":
            a = a[:n_vocab_real]
        written[gguf_name(name)] = a
        w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
