"""Gemma 2 and Gemma 3 (text): reading their HF and GGUF configs into ModelConfig switches.

The decoder has no Gemma code path: a Gemma model is a ModelConfig with these switches on

    layer_types          per layer "sliding_attention" | "full_attention" (HF's list)
    rope_local_theta     RoPE base of the sliding layers (Gemma 3; no rope scaling there)
    attn_logit_softcap   cap * tanh(scores / cap) before the mask (Gemma 2 only: transformers
                         does not pass Gemma 3's attn_logit_softcapping to attention)
    final_logit_softcap  the same on the logits (Gemma 2; Gemma 3 configs carry null)
    query_pre_attn_scalar  scores scaled by its -1/2 power instead of head_dim's
    hidden_act           "gelu_tanh": GeGLU with the tanh-approximate GELU
    norm_offset          1.0: every RMSNorm multiplies by (1 + weight), q/k norms included
    sandwich_norms       norms after attention and after the MLP as well as before
    embed_scale          embeddings times sqrt(hidden), rounded to the embedding dtype

(1 + weight) is a config switch, not folded into the weights at load time: transformers
adds the 1 in float32 to the bf16 weight, which a bf16 (1 + w) stored at load would round
(to 2^-9), and weights that keep the checkpoint's meaning export and convert unchanged.
GGUF files store 1 + w (llama.cpp's converter adds it), so the GGUF loader subtracts it.

Sliding windows: HF masks key j for query i unless j > i - sliding_window, i.e. a query
sees itself and the sliding_window - 1 tokens before it; llama.cpp (|i - j| >= n_swa is
masked) and every attention backend here use the same convention.
"""
from __future__ import annotations

from typing import Any, Callable

from jaxserve.model.errors import UnsupportedModelError

GEMMA_ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                       "Gemma3ForConditionalGeneration": "gemma3_text"}
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
GEMMA_ACTS = ("gelu_pytorch_tanh", "gelu_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 3 defaults where a config.json leaves them out (transformers' Gemma3TextConfig)
GEMMA3_THETA = {"global": 1_000_000.0, "local": 10_000.0}


def is_gemma(hf: dict[str, Any]) -> bool:
    archs = hf.get("architectures") or []
    return (archs[0] if archs else None) in GEMMA_ARCHITECTURES or hf.get("model_type") in (
        "gemma2", "gemma3", "gemma3_text")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config -> its language model's config (the vision
    tower is not loaded: see text_tensor_name); any other config unchanged."""
    if "text_config" not in hf:
        return hf
    text = dict(hf["text_config"] or {})
    text["architectures"] = ["Gemma3ForCausalLM"]
    text.setdefault("model_type", "gemma3_text")
    for k in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"):
        if k in hf and k not in text:
            text[k] = hf[k]
    if "tie_word_embeddings" in hf:   # the wrapper's flag is the one transformers ties by
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def text_tensor_name(name: str) -> str | None:
    """A multimodal Gemma 3 checkpoint's tensor name -> the text model's name, or None for
    the vision tower and projector (not loaded). Both layouts: transformers 5
    ("model.language_model.*") and 4.x ("language_model.model.*")."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    return None


def _rope(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Gemma 3's per-layer-type rope_parameters (transformers 5) or its older top-level
    rope_theta / rope_local_base_freq / rope_scaling -> the global layers' rope_parameters
    (what the generic parser reads) and the local base."""
    params = hf.get("rope_parameters")
    if family != "gemma3_text":
        return {"rope_parameters": params, "rope_local_theta": None}
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"rope scaling on Gemma 3 sliding layers "
                                        f"({local.get('rope_type')!r}) is not supported")
    else:
        full = dict(hf.get("rope_scaling") or params or {})
        local = {"rope_theta": hf.get("rope_local_base_freq")}
        full.setdefault("rope_theta", hf.get("rope_theta"))
    full["rope_theta"] = float(full.get("rope_theta") or GEMMA3_THETA["global"])
    local_theta = float(local.get("rope_theta") or GEMMA3_THETA["local"])
    return {"rope_parameters": full, "rope_local_theta": local_theta}


def default_layer_types(family: str, num_layers: int, pattern: int | None = None) -> tuple[str, ...]:
    """transformers' default: Gemma 2 alternates sliding/full (pattern 2), Gemma 3 has five
    sliding layers then one full (pattern 6); layer i is full when (i + 1) % pattern == 0."""
    pattern = pattern or (2 if family == "gemma2" else 6)
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def gemma_fields(hf: dict[str, Any], family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf dict for the generic parser, extra ModelConfig fields) of a Gemma config."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTS:
        raise UnsupportedModelError(f"unsupported Gemma hidden_activation {act!r} "
                                    f"(supported: {list(GEMMA_ACTS)})")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional Gemma attention (an embedding model) is "
                                    "not supported by a causal LM server")
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    types = tuple(types) if types else default_layer_types(
        family, n, hf.get("sliding_window_pattern"))
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise UnsupportedModelError(f"layer_types must list {SLIDING!r} or {FULL!r} for each "
                                    f"of the {n} layers, got {list(types)}")
    rope = _rope(hf, family)
    window = hf.get("sliding_window", 4096)
    if SLIDING in types and not window:
        raise UnsupportedModelError("Gemma sliding layers need a sliding_window")
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    soft = hf.get("attn_logit_softcapping", 50.0) if family == "gemma2" else None
    final = hf.get("final_logit_softcapping", 30.0 if family == "gemma2" else None)
    generic = dict(hf)
    if family == "gemma3_text":     # the global layers' RoPE, flattened for the generic parser
        generic.pop("rope_scaling", None)
        generic.pop("rope_theta", None)
        generic["rope_parameters"] = rope["rope_parameters"]
    generic.update(hidden_act="silu",
                   use_sliding_window=False, head_dim=head_dim,
                   tie_word_embeddings=hf.get("tie_word_embeddings", True))
    extra = dict(layer_types=types, sliding_window=int(window) if SLIDING in types else None,
                 rope_local_theta=rope["rope_local_theta"],
                 attn_logit_softcap=float(soft) if soft else None,
                 final_logit_softcap=float(final) if final else None,
                 query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                 hidden_act="gelu_tanh", norm_offset=1.0, sandwich_norms=True,
                 embed_scale=True, qk_norm=family == "gemma3_text")
    return generic, extra


def gemma_hf_dict(cfg: Any, generic: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig.to_hf_dict of a Gemma config: the generic dict with Gemma's fields (its
    RoPE as rope_parameters, no rope_theta / rope_scaling / use_sliding_window keys)."""
    d = {k: v for k, v in generic.items()
         if k not in ("rope_theta", "rope_scaling", "use_sliding_window")}
    d.update({
        "model_type": cfg.family, "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window or 4096,
        # an int in transformers' strict config (27B: 144 / 168); kept exact otherwise
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar),
        "final_logit_softcapping": cfg.final_logit_softcap,
        "hidden_activation": "gelu_pytorch_tanh"})
    if cfg.family == "gemma2":
        d["attn_logit_softcapping"] = cfg.attn_logit_softcap
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        full = dict(cfg.rope_scaling_dict or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
        d["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default",
                                                      "rope_theta": cfg.rope_local_theta}}
    return d


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


# ---------------------------------------------------------------------------- GGUF

GGUF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp's block tensor names for the four Gemma norms (its "ffn_norm" is the
# pre-feed-forward norm here, not Llama's post_attention_layernorm)
GGUF_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}


def gguf_fields(arch: str, get: Callable[[str, Any], Any], num_layers: int, hidden: int,
                heads: int, head_dim: int) -> dict[str, Any]:
    """HF config fields of a llama.cpp gemma2 / gemma3 GGUF, as llama.cpp reads them
    (src/models/gemma2.cpp, gemma3.cpp): sliding layers by `attention.sliding_window_pattern`
    (default 2 / 6: layer i slides when i % n < n - 1), the local RoPE base
    `rope.freq_base_swa` (Gemma 2: the global base; Gemma 3: 10000), and scores scaled by
    head_dim^-1/2 except for the 27B models (46 / 62 layers: (hidden / heads)^-1/2)."""
    family = "gemma2" if arch == "gemma2" else "gemma3_text"
    window = get("attention.sliding_window", 4096 if arch == "gemma2" else 0)
    pattern = get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, (list, tuple)):
        types = tuple(SLIDING if p else FULL for p in pattern)
    else:
        p = int(pattern)
        types = tuple(SLIDING if p == 0 or i % p < p - 1 else FULL for i in range(num_layers))
    if not window:
        types = (FULL,) * num_layers
    big = num_layers == (46 if arch == "gemma2" else 62)
    theta = float(get("rope.freq_base", 10000.0 if arch == "gemma2" else 1_000_000.0))
    local = get("rope.freq_base_swa", theta if arch == "gemma2" else GEMMA3_THETA["local"])
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if get("rope.scaling.type", "none") == "linear":
        full.update(rope_type="linear", factor=float(get("rope.scaling.factor", 1.0)))
    elif get("rope.scaling.type", "none") != "none":
        raise UnsupportedModelError(f"unsupported GGUF rope scaling "
                                    f"{get('rope.scaling.type', None)!r} for {arch}")
    d: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]], "model_type": family,
        "layer_types": list(types), "sliding_window": int(window) if window else None,
        "query_pre_attn_scalar": hidden / heads if big else head_dim,
        "final_logit_softcapping": get("final_logit_softcapping", None),
        "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma2":
        d["attn_logit_softcapping"] = get("attn_logit_softcapping", None)
        if float(local) != theta:
            raise UnsupportedModelError("a Gemma 2 GGUF with its own sliding-layer RoPE base "
                                        "is not supported")
        d["rope_parameters"] = full
    else:
        d["rope_parameters"] = {FULL: full,
                                SLIDING: {"rope_type": "default", "rope_theta": float(local)}}
    return d
