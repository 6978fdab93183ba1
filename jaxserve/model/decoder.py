"""One functional decoder for the Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3) and
Gemma 2/3 (config switches: model/gemma.py).

    forward(weights, kv, tokens, md, cfg) -> (hidden [T, D], kv')

Layers are a Python loop over per-layer weights and KV buffers (measured faster
than lax.scan on CPU). The attention function is pluggable
(reference jnp or Pallas) and always sees the same metadata. A layer's attention kind
(cfg.layer_kind: sliding or full, Gemma) is static: its window and RoPE base are
Python values, so each kind is its own trace.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.attention import reference
from jaxserve.attention.kv_writing import writes_kv
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.attention import kv_quant
from jaxserve.attention import kv_layout as kv_layout_mod
from jaxserve.model.cpu import stack as cpu_stack
from jaxserve.model import lora
from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import apply_rope, mlp, rms_norm, rope_inv_freq
from jaxserve.model.linear import XLA_LINEAR, Linear
from jaxserve.model.moe import moe_mlp

KVCache = list  # [(k [K, B, bs, H], v [K, B, bs, H]) per layer] (or quant.QuantizedKV each;
                # page-major: (kv [B, 2K, bs, H], None), attention/kv_layout.py)
AttentionFn = Callable[..., jax.Array]


def attention_block(x: jax.Array, layer: dict, k_cache: jax.Array, v_cache: jax.Array,
                    md: AttentionMetadata, cfg: ModelConfig, inv_freq: jax.Array,
                    attn_fn: AttentionFn, kind: str = "default"
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    T = x.shape[0]
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = cfg.linear.many(x, [layer["wq"], layer["wk"], layer["wv"]])
    if "lora" in layer:         # adapters (model/lora.py): each token's slot's delta
        q, k, v = (lora.add_delta(t, x, layer, key, md.lora_slots)
                   for t, key in ((q, "wq"), (k, "wk"), (v, "wv")))
    if cfg.attention_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    if cfg.qk_norm_full:    # OLMoE: one RMSNorm over all heads of q (and of k)
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:
        q, k, v = (jnp.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if kind == "sliding_attention" and cfg.rope_local_theta is not None:
        inv_freq = jnp.asarray(rope_inv_freq(cfg, local=True))   # Gemma 3 local layers
    q = apply_rope(q, md.positions, inv_freq)
    k = apply_rope(k, md.positions, inv_freq)
    if cfg.kv_head_replicas > 1:    # TP > K: each rank's cache slice holds its own copy
        k = jnp.repeat(k, cfg.kv_head_replicas, axis=1)
        v = jnp.repeat(v, cfg.kv_head_replicas, axis=1)
    kw: dict[str, Any] = dict(scale=cfg.attention_scale, sliding_window=cfg.window_of(kind))
    if cfg.attn_logit_softcap is not None:
        kw["soft_cap"] = cfg.attn_logit_softcap
    if writes_kv(attn_fn):      # the kernel writes k/v into the caches (TPU: fused update)
        out, k_cache, v_cache = attn_fn(q, k, v, k_cache, v_cache, md, **kw)
    else:
        k_cache, v_cache = reference.write_kv(k_cache, v_cache, k, v, md.slot_mapping)
        out = attn_fn(q, k, v, k_cache, v_cache, md, **kw)
    out = out.reshape(T, N * H)
    return (lora.add_delta(cfg.linear(out, layer["wo"]), out, layer, "wo", md.lora_slots),
            k_cache, v_cache)


def forward(weights: dict[str, Any], kv: KVCache, tokens: jax.Array, md: AttentionMetadata,
            cfg: ModelConfig, inv_freq: jax.Array,
            attn_fn: AttentionFn = reference.paged_attention) -> tuple[jax.Array, KVCache]:
    """tokens [T] -> final-normed hidden states [T, D] and the updated KV cache."""
    x, new_kv = layers_forward(weights, kv, tokens, md, cfg, inv_freq, attn_fn)
    return final_norm(weights, x, cfg), new_kv


def layers_forward(weights: dict[str, Any], kv: KVCache, tokens: jax.Array,
                   md: AttentionMetadata, cfg: ModelConfig, inv_freq: jax.Array,
                   attn_fn: AttentionFn = reference.paged_attention
                   ) -> tuple[jax.Array, KVCache]:
    """forward without the final norm: the last layer's output [T, D] and the KV cache."""
    x = embed_tokens(weights["embed"], tokens, cfg)
    if cpu_stack.usable(weights, kv, tokens.shape[0], cfg, attn_fn):
        return cpu_stack.layers_forward(weights, kv, x, md, cfg, inv_freq)   # one CPU call
    md = prepare_attention(attn_fn, md, cfg)
    new_kv = []
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(weights["layers"], kv)):
        x, k_cache, v_cache = decoder_layer(x, layer, k_cache, v_cache, md, cfg, inv_freq,
                                            attn_fn, cfg.layer_kind(i))
        new_kv.append((k_cache, v_cache))
    return x, new_kv


def prepare_attention(attn_fn: AttentionFn, md: AttentionMetadata,
                      cfg: ModelConfig) -> AttentionMetadata:
    """Per-step work of the attention function shared by all layers (the GPU kernel's
    query tiles: attn_fn.prepare_step), done once before the first layer."""
    prepare = getattr(attn_fn, "prepare_step", None)
    return md if prepare is None else prepare(md, cfg.num_heads, cfg.num_kv_heads)


def embed_tokens(embed: jax.Array, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """tokens [T] -> [T, D]; Gemma scales by sqrt(D) rounded to the embedding dtype first,
    as transformers does (bf16: sqrt(3072) becomes 55.5, not 55.43)."""
    x = embed[tokens]
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, jnp.float32).astype(x.dtype)
    return x


def final_norm(weights: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final RMSNorm (weights: the model's, or just its head: final_norm, embed...)."""
    return rms_norm(x, weights["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)


def decoder_layer(x: jax.Array, layer: dict, k_cache: jax.Array, v_cache: jax.Array,
                  md: AttentionMetadata, cfg: ModelConfig, inv_freq: jax.Array,
                  attn_fn: AttentionFn, kind: str = "default"
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pre-norm block (sandwich_norms: the attention and MLP outputs normed too, before
    each residual add): x [T, D] -> x [T, D], with this layer's KV cache updated.
    kind: cfg.layer_kind(i) (static)."""
    assert kind != "default" or cfg.layer_types is None, "pass cfg.layer_kind(i)"
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    h = rms_norm(x, layer["attn_norm"], eps, off)
    a, k_cache, v_cache = attention_block(h, layer, k_cache, v_cache, md, cfg, inv_freq, attn_fn,
                                          kind)
    if cfg.sandwich_norms:
        a = rms_norm(a, layer["post_attn_norm"], eps, off)
    x = x + a
    m = feed_forward(rms_norm(x, layer["mlp_norm"], eps, off), layer, cfg, md.lora_slots)
    if cfg.sandwich_norms:
        m = rms_norm(m, layer["post_mlp_norm"], eps, off)
    x = x + m
    return x, k_cache, v_cache


def feed_forward(x: jax.Array, layer: dict, cfg: ModelConfig,
                 lora_slots: jax.Array | None = None) -> jax.Array:
    """x [T, D] -> [T, D]: the MoE block where the layer has a router (model/moe.py),
    else the dense MLP (with the adapters' deltas where lora_slots is given)."""
    if "router" in layer:
        return moe_mlp(x, layer, cfg)
    return mlp(x, layer, cfg.linear, cfg.hidden_act, lora_slots)


def compute_logits(weights: dict[str, Any], hidden: jax.Array,
                   linear: Linear = XLA_LINEAR, soft_cap: float | None = None) -> jax.Array:
    """hidden [R, D] -> float32 logits [R, V] (tied or untied head); linear:
    ModelConfig.linear, the one that reads these weights; soft_cap:
    ModelConfig.final_logit_softcap (Gemma 2: cap * tanh(logits / cap))."""
    if "head_packed" in weights:      # a tied head packed for the CPU kernel (model/cpu/matmul.py)
        logits = linear.head(hidden, weights["head_packed"])
    elif "lm_head" in weights:
        logits = linear.head(hidden, weights["lm_head"])
    else:
        logits = linear.tied(hidden, weights["embed"])
    logits = logits.astype(jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits


def init_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any,
                  kv_cache_dtype: str = "auto", kv_layout: str = kv_layout_mod.HEAD_MAJOR
                  ) -> KVCache:
    """Zeroed per-layer (k, v); kv_cache_dtype int8 / fp8: each a quant.QuantizedKV.
    kv_layout page_major: per-layer (kv, None) (attention/kv_layout.py).

    One program makes them all: 2 x num_layers eager zeros each blocked the host while
    it filled its array. On CPU the call returns once the arrays are filled (the runner
    calls this on a thread beside its weight packing)."""
    shape = kv_layout_mod.cache_shape(kv_layout, cfg.num_kv_heads * cfg.kv_head_replicas,
                                      num_blocks, block_size, cfg.head_dim)
    return _zeroed_kv(shape, cfg.num_layers, kv_cache_dtype, jnp.dtype(dtype), kv_layout)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _zeroed_kv(shape: tuple[int, ...], num_layers: int, kv_cache_dtype: str,
               dtype: Any, layout: str) -> KVCache:
    return [kv_layout_mod.layer(layout, lambda: kv_quant.init_layer(shape, kv_cache_dtype,
                                                                     dtype))
            for _ in range(num_layers)]
