"""Parameters described once: shape, logical axes, HF tensor name.

The weights pytree is

    {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (untied only),
     "layers": [ {per-layer dict}, ... ]}    # a Python list: one dict per layer

Per-layer keys: attn_norm [D], wq [D, N*H], wk [D, K*H], wv [D, K*H], wo [N*H, D],
(bq [N*H], bk [K*H], bv [K*H] with attention_bias), (q_norm [H], k_norm [H] with qk_norm),
mlp_norm [D], w_gate [D, F], w_up [D, F], w_down [F, D] (an MoE layer instead: router
[D, E], w_gate_e [E, D, F], w_up_e [E, D, F], w_down_e [E, F, D]); with sandwich_norms
(Gemma) also
post_attn_norm [D] and post_mlp_norm [D] (mlp_norm is then HF's pre_feedforward_layernorm).

Matrices are stored input-major (x @ w), i.e. transposed with respect to HF's
nn.Linear weights; `hf_transpose` says which ones. Shapes, shardings and random
initialisation are all derived from `param_specs`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import quant
from jaxserve.model.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]   # e.g. ("embed", "heads"); see parallel/rules
    hf_name: str                           # tensor name in an HF safetensors checkpoint
    hf_transpose: bool = False             # HF stores [out, in]; we store [in, out]
    init: str = "normal"                   # "normal" | "ones" | "zeros"
    # Expert weights [E, ...]: HF stores one tensor per expert (hf_name is then only a
    # pattern); the loader stacks these, each transposed by hf_transpose.
    hf_stack: tuple[str, ...] = ()


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": ParamSpec((D,), ("embed",), p + "input_layernorm.weight", init="ones"),
            "wq": ParamSpec((D, N * H), ("embed", "heads"), p + "self_attn.q_proj.weight", True),
            "wk": ParamSpec((D, K * H), ("embed", "kv_heads"), p + "self_attn.k_proj.weight", True),
            "wv": ParamSpec((D, K * H), ("embed", "kv_heads"), p + "self_attn.v_proj.weight", True),
            "wo": ParamSpec((N * H, D), ("heads", "embed"), p + "self_attn.o_proj.weight", True),
            "mlp_norm": ParamSpec((D,), ("embed",), p + "post_attention_layernorm.weight", init="ones"),
            "w_gate": ParamSpec((D, F), ("embed", "ffn"), p + "mlp.gate_proj.weight", True),
            "w_up": ParamSpec((D, F), ("embed", "ffn"), p + "mlp.up_proj.weight", True),
            "w_down": ParamSpec((F, D), ("ffn", "embed"), p + "mlp.down_proj.weight", True),
        }
        if cfg.sandwich_norms:   # Gemma: norms after attention and after the MLP too
            layer["post_attn_norm"] = layer["mlp_norm"]     # HF post_attention_layernorm
            layer["mlp_norm"] = ParamSpec((D,), ("embed",), p + "pre_feedforward_layernorm.weight",
                                          init="ones")
            layer["post_mlp_norm"] = ParamSpec((D,), ("embed",),
                                               p + "post_feedforward_layernorm.weight", init="ones")
        if cfg.attention_bias:
            layer["bq"] = ParamSpec((N * H,), ("heads",), p + "self_attn.q_proj.bias", init="zeros")
            layer["bk"] = ParamSpec((K * H,), ("kv_heads",), p + "self_attn.k_proj.bias", init="zeros")
            layer["bv"] = ParamSpec((K * H,), ("kv_heads",), p + "self_attn.v_proj.bias", init="zeros")
        if cfg.qk_norm:
            layer["q_norm"] = ParamSpec((H,), (None,), p + "self_attn.q_norm.weight", init="ones")
            layer["k_norm"] = ParamSpec((H,), (None,), p + "self_attn.k_norm.weight", init="ones")
        if cfg.qk_norm_full:    # OLMoE: one norm over all heads of q, and of k
            layer["q_norm"] = ParamSpec((N * H,), ("heads",), p + "self_attn.q_norm.weight",
                                        init="ones")
            layer["k_norm"] = ParamSpec((K * H,), ("kv_heads",), p + "self_attn.k_norm.weight",
                                        init="ones")
        if cfg.is_moe_layer(i):
            for dense in ("w_gate", "w_up", "w_down"):
                del layer[dense]
            layer.update(expert_specs(cfg, p))
        layers.append(layer)
    specs: dict[str, Any] = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), "model.embed_tokens.weight"),
        "final_norm": ParamSpec((D,), ("embed",), "model.norm.weight", init="ones"),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "lm_head.weight", True)
    if cfg.norm_offset:     # norms scale by (offset + w): their neutral weight is 0, not 1
        specs = jax.tree_util.tree_map(
            lambda s: dataclasses.replace(s, init="zeros") if s.init == "ones" else s,
            specs, is_leaf=is_spec)
    return specs


# Per MoE family: HF module of the block, and its per-expert gate, up, down projections.
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def expert_specs(cfg: ModelConfig, p: str) -> dict[str, ParamSpec]:
    """An MoE layer's router [D, E] and expert weights w_gate_e / w_up_e [E, D, F],
    w_down_e [E, F, D] (F: moe_intermediate_size), E on the `expert` logical axis."""
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    mod, gate, up, down = EXPERT_NAMES.get(cfg.family, EXPERT_NAMES["qwen3_moe"])

    def stacked(proj: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> ParamSpec:
        names = tuple(f"{p}{mod}.experts.{e}.{proj}.weight" for e in range(E))
        return ParamSpec(shape, axes, f"{p}{mod}.experts.*.{proj}.weight", True,
                         hf_stack=names)

    return {"router": ParamSpec((D, E), ("embed", None), f"{p}{mod}.gate.weight", True),
            "w_gate_e": stacked(gate, (E, D, F), ("expert", "embed", "moe_ffn")),
            "w_up_e": stacked(up, (E, D, F), ("expert", "embed", "moe_ffn")),
            "w_down_e": stacked(down, (E, F, D), ("expert", "moe_ffn", "embed"))}


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def iter_specs(specs: dict[str, Any]) -> Iterator[tuple[tuple, ParamSpec]]:
    """Yield (pytree path, spec) for every parameter."""
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    yield from leaves


def set_at_path(tree: Any, path: tuple, value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node[_key(key)]
    node[_key(path[-1])] = value


def _key(k: Any) -> Any:
    return k.key if hasattr(k, "key") else k.idx


def abstract_params(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype),
                                  param_specs(cfg), is_leaf=is_spec)


def init_params(cfg: ModelConfig, dtype: Any = jnp.float32, seed: int = 0,
                scale: float = 0.02) -> dict[str, Any]:
    """Random weights (tests and benchmarks); same tree as a loaded checkpoint."""
    rng = np.random.default_rng(seed)

    def make(s: ParamSpec) -> jax.Array:
        if s.init == "ones":
            a = np.ones(s.shape, np.float32)
        elif s.init == "zeros":
            a = np.zeros(s.shape, np.float32)
        else:
            a = rng.normal(0.0, scale, s.shape).astype(np.float32)
        return jnp.asarray(a, dtype)

    return jax.tree_util.tree_map(make, param_specs(cfg), is_leaf=is_spec)


def quantize_weights(cfg: ModelConfig, weights: dict[str, Any], kind: str, *,
                     act: str = "none", embed: bool = True) -> dict[str, Any]:
    """Every projection (and, with embed=True, the embedding / head) as int8 or fp8
    per-output-channel QArrays; norms and biases stay float.

    act="int8" also quantizes activations per row for an int8 x int8 dot (the TPU MXU /
    GPU tensor-core fast path, and 1.4-1.6x faster than fp32 on XLA:CPU at 64+ rows).
    It is not the default anywhere: on SmolLM2-135M it missed the quality bar
    (docs/benchmarks.md, "Quantization": activation outliers), weight-only did not."""
    if act not in quant.ACTIVATIONS:
        raise ValueError(f"act must be one of {quant.ACTIVATIONS}, got {act!r}")

    def one(spec: Any, w: Any) -> Any:
        if quant.is_quantized(w) or len(spec.shape) != 2:
            return w
        if not embed and spec.hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return w
        m = np.asarray(w, np.float32)
        q = quant.quantize_matrix(m.T if spec.hf_transpose else m, kind, w.dtype, act)
        return q.map_parts(lambda _, p: jnp.asarray(p))

    return jax.tree_util.tree_map(one, param_specs(cfg), weights, is_leaf=is_spec)
