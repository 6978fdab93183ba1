"""Test helpers: tiny random transformers models saved as HF dirs, a tiny tokenizer,
a tiny GGUF writer, and a reference greedy generator on jaxserve's forward().

The generator uses the real paged KV cache path (prefill padded to a bucket, then
one-token decode steps with context), so it also exercises metadata handling.
"""
from __future__ import annotations

import string
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.model import decoder
from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import rope_inv_freq

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 10000.0}
# name -> (transformers config class, overrides of TINY)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_llama3_tied_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                                 tie_word_embeddings=True,
                                                 rope_parameters=LLAMA3_ROPE)),
    "llama_linear_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1,
                                            rope_parameters={"rope_type": "linear",
                                                             "factor": 2.0,
                                                             "rope_theta": 10000.0})),
    "llama_headdim24": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=24)),
    "mistral_sliding": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=8)),
    "qwen2_bias_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=True)),
    "qwen3_qknorm_headdim24": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=24, tie_word_embeddings=False)),
}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A character-level fast tokenizer (ids < 128) with a chat template."""
    chars = string.printable
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    return fast


def make_hf_model(variant: str, seed: int = 0) -> transformers.PreTrainedModel:
    cls_name, over = VARIANTS[variant]
    cfg = getattr(transformers, cls_name)(**{**TINY, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases are ones/zeros at init: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model


def save_hf_model(variant: str, path: Path, seed: int = 0, **save_kw: Any
                  ) -> transformers.PreTrainedModel:
    model = make_hf_model(variant, seed)
    model.save_pretrained(str(path), safe_serialization=True, **save_kw)
    tiny_tokenizer().save_pretrained(str(path))
    return model


def hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model: transformers.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------- jaxserve generator

def _metadata(positions: np.ndarray, num_real: int, num_slots: int, P: int,
              context_len: int) -> AttentionMetadata:
    T = len(positions)
    real = np.arange(T) < num_real
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
    return AttentionMetadata(
        positions=i32(np.where(real, positions, 0)),
        slot_mapping=i32(np.where(real, positions, num_slots)),
        token_rows=i32(np.where(real, 0, 1)),
        context_lens=i32([context_len]),
        seq_lens=i32([context_len + num_real]),
        query_start_loc=i32([0, num_real]),
        block_tables=i32(np.arange(P)[None, :]),
        logits_indices=i32([num_real - 1]))


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def _step(weights, kv, tokens, md, inv_freq, cfg):
    hidden, kv = decoder.forward(weights, kv, tokens, md, cfg, inv_freq)
    return decoder.compute_logits(weights, hidden), kv


class Generator:
    """Greedy decoding with jaxserve's forward: one padded prefill, then decode steps.

    Shapes are fixed (prefill bucket, context blocks), so each model compiles twice.
    """

    def __init__(self, weights: dict, cfg: ModelConfig, max_len: int = 256,
                 block_size: int = 16, prefill_bucket: int = 128):
        self.weights, self.cfg = weights, cfg
        self.blocks = -(-max_len // block_size)
        self.block_size, self.bucket = block_size, prefill_bucket
        self.inv_freq = jnp.asarray(rope_inv_freq(cfg))
        self.dtype = weights["embed"].dtype

    def prefill(self, ids: list[int]) -> tuple[np.ndarray, Any]:
        """Logits [T, V] of the whole prompt, and the filled KV cache."""
        T = len(ids)
        assert T <= self.bucket
        kv = decoder.init_kv_cache(self.cfg, self.blocks, self.block_size, self.dtype)
        tokens = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, self.bucket - T)))
        md = _metadata(np.arange(self.bucket), T, self.blocks * self.block_size, 0, 0)
        logits, kv = _step(self.weights, kv, tokens, md, self.inv_freq, self.cfg)
        return np.asarray(logits[:T]), kv

    def greedy(self, ids: list[int], n: int) -> list[int]:
        logits, kv = self.prefill(ids)
        out = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            pos = len(ids) + len(out) - 1
            md = _metadata(np.array([pos]), 1, self.blocks * self.block_size, self.blocks, pos)
            logits, kv = _step(self.weights, kv, jnp.asarray([out[-1]], jnp.int32), md,
                               self.inv_freq, self.cfg)
            out.append(int(np.asarray(logits[0]).argmax()))
        return out


# ---------------------------------------------------------------- tiny GGUF files

def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_llama_gguf(path: Path, model: transformers.PreTrainedModel, qtype: Any = None,
                     extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny Llama as llama.cpp would (permuted q/k). qtype quantizes the 2-D
    weights whose rows fit its block size. Returns the dequantized HF tensors written."""
    import gguf
    from gguf.quants import dequantize, quantize

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    written = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.float().numpy()
        g = name
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            mod, kind = rest.rsplit(".", 1)
            g = f"blk.{i}.{GGUF_BLOCK[mod]}.{kind}"
            if mod == "self_attn.q_proj":
                a = permute_rows(a, c.num_attention_heads)
            elif mod == "self_attn.k_proj":
                a = permute_rows(a, c.num_key_value_heads)
        else:
            g = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        if qtype is not None and a.ndim == 2 and a.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            q = quantize(a, qtype)
            w.add_tensor(g, q, raw_dtype=qtype)
            written[g] = dequantize(q, qtype)
        else:
            w.add_tensor(g, a)
            written[g] = a
    for g, a in (extra_tensors or {}).items():
        w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
