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

# Not in the parity grid: rows of 256 so that K-quant blocks (256 values) fit.
LOADER_VARIANTS = {"llama_k256": ("LlamaConfig", dict(hidden_size=256, intermediate_size=256,
                                                      num_hidden_layers=1, num_attention_heads=4,
                                                      num_key_value_heads=2))}


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
    cls_name, over = {**VARIANTS, **LOADER_VARIANTS}[variant]
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
    """n greedy tokens with transformers' own KV cache (a plain loop: generate() is slow)."""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            if len(out) < n:
                res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values,
                            use_cache=True)
    return out


# ---------------------------------------------------------------- jaxserve generator

def _i32(a: Any) -> jax.Array:
    return jnp.asarray(np.asarray(a, np.int32))


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def _prefill(weights, kv, tokens, md, inv_freq, cfg):
    hidden, kv = decoder.forward(weights, kv, tokens, md, cfg, inv_freq)
    return decoder.compute_logits(weights, hidden, soft_cap=cfg.final_logit_softcap), kv


@partial(jax.jit, static_argnames=("cfg", "steps", "block_size"))
def _decode(weights, kv, first, start, inv_freq, cfg, steps, block_size):
    """Greedy decode `steps` tokens for R rows at once; row r owns blocks r*P..r*P+P-1."""
    R = first.shape[0]
    P = kv[0][0].shape[1] // R
    rows = jnp.arange(R, dtype=jnp.int32)
    tables = rows[:, None] * P + jnp.arange(P, dtype=jnp.int32)[None, :]

    def step(carry, _):
        kv, tok, pos = carry
        md = AttentionMetadata(positions=pos, slot_mapping=rows * P * block_size + pos,
                               token_rows=rows, context_lens=pos, seq_lens=pos + 1,
                               query_start_loc=jnp.arange(R + 1, dtype=jnp.int32),
                               block_tables=tables, logits_indices=rows)
        hidden, kv = decoder.forward(weights, kv, tok, md, cfg, inv_freq)
        logits = decoder.compute_logits(weights, hidden, soft_cap=cfg.final_logit_softcap)
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        return (kv, nxt, pos + 1), nxt

    _, toks = jax.lax.scan(step, (kv, first, start), None, length=steps)
    return toks.T                                                       # [R, steps]


class Generator:
    """Greedy decoding with jaxserve's forward over the paged KV cache.

    All prompts go as one ragged prefill step (rows of a flat, padded token batch),
    then one-token-per-row decode steps with context, inside one jitted scan.
    """

    def __init__(self, weights: dict, cfg: ModelConfig, block_size: int = 16,
                 bucket: int = 64, extra: int = 0):
        self.weights, self.cfg, self.extra = weights, cfg, extra   # extra: KV room
        self.block_size, self.bucket = block_size, bucket
        self.inv_freq = jnp.asarray(rope_inv_freq(cfg))
        self.dtype = weights["embed"].dtype

    def prefill(self, prompts: list[list[int]], max_len: int) -> tuple[np.ndarray, Any, int]:
        """-> logits of every prompt token [sum(len), V], KV cache, blocks per row."""
        R, bs = len(prompts), self.block_size
        P = -(-max_len // bs)
        lens = [len(p) for p in prompts]
        T = sum(lens)
        Tp = -(-T // self.bucket) * self.bucket
        rows = np.repeat(np.arange(R), lens)
        pos = np.concatenate([np.arange(n) for n in lens])
        pad = Tp - T
        md = AttentionMetadata(
            positions=_i32(np.pad(pos, (0, pad))),
            slot_mapping=_i32(np.pad(rows * P * bs + pos, (0, pad), constant_values=R * P * bs)),
            token_rows=_i32(np.pad(rows, (0, pad), constant_values=R)),
            context_lens=_i32(np.zeros(R)), seq_lens=_i32(lens),
            query_start_loc=_i32(np.concatenate([[0], np.cumsum(lens)])),
            block_tables=_i32(np.zeros((R, 0))), logits_indices=_i32(np.cumsum(lens) - 1))
        kv = decoder.init_kv_cache(self.cfg, R * P, bs, self.dtype)
        tokens = _i32(np.pad(np.concatenate(prompts), (0, pad)))
        logits, kv = _prefill(self.weights, kv, tokens, md, self.inv_freq, self.cfg)
        return np.asarray(logits[:T]), kv, P

    def logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Full-sequence logits [len, V] of each prompt."""
        logits, _, _ = self.prefill(prompts, max(len(p) for p in prompts) + self.extra)
        return np.split(logits, np.cumsum([len(p) for p in prompts])[:-1])

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """n greedy tokens after each prompt (EOS ignored)."""
        logits, kv, _ = self.prefill(prompts, max(len(p) for p in prompts) + max(n, self.extra))
        last = np.cumsum([len(p) for p in prompts]) - 1
        first = logits[last].argmax(-1).astype(np.int32)
        rest = _decode(self.weights, kv, jnp.asarray(first), _i32([len(p) for p in prompts]),
                       self.inv_freq, self.cfg, n - 1, self.block_size)
        return np.concatenate([first[:, None], np.asarray(rest)], 1).tolist()


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
                     extra_tensors: dict[str, np.ndarray] | None = None,
                     raw: dict[str, tuple[np.ndarray, Any]] | None = None,
                     arch: str = "llama") -> dict[str, np.ndarray]:
    """Write a tiny Llama as llama.cpp would (permuted q/k). qtype quantizes the 2-D
    weights whose rows fit its block size; raw replaces a tensor by (bytes, type).
    Returns what was written, dequantized, by GGUF name (q/k still permuted)."""
    import gguf
    from gguf.quants import dequantize, quantize

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
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
        if raw and g in raw:
            data, rtype = raw[g]
            w.add_tensor(g, data, raw_dtype=rtype)
            written[g] = dequantize(data, rtype)
        elif qtype is not None and a.ndim == 2 and a.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
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
