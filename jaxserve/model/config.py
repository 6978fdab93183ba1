"""ModelConfig: the static description of one decoder, read from an HF config dict.

Every supported family (Llama 1/2/3/3.1, Mistral, Qwen2, Qwen3, Gemma 2/3) is a set of switches
on this one dataclass; `decoder.py` reads only these fields.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxserve.model import gemma
from jaxserve.model.errors import UnsupportedModelError
from jaxserve.model.linear import XLA_LINEAR, Linear

__all__ = ["ModelConfig", "UnsupportedModelError", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str              # HF class name, e.g. "LlamaForCausalLM"
    family: str                    # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3_text"
    vocab_size: int                # V
    hidden_size: int               # D
    intermediate_size: int         # F
    num_layers: int
    num_heads: int                 # N
    num_kv_heads: int              # K
    head_dim: int                  # H
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None   # frozen dict items
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v projection biases (Qwen2)
    qk_norm: bool = False          # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    # Gemma 2 / 3 switches (model/gemma.py says what each does; defaults: Llama behaviour)
    layer_types: tuple[str, ...] | None = None   # per layer "sliding_attention"|"full_attention"
    rope_local_theta: float | None = None        # RoPE base of sliding layers (Gemma 3)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None   # attention scale = this ** -0.5 (else H)
    hidden_act: str = "silu"                     # "silu" | "gelu_tanh" (GeGLU)
    norm_offset: float = 0.0                     # RMSNorm scales by (norm_offset + weight)
    sandwich_norms: bool = False                 # norms after attention and MLP too
    embed_scale: bool = False                    # embeddings times sqrt(hidden_size)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (model/moe.py); num_experts 0: a dense MLP in every layer.
    num_experts: int = 0           # E
    num_experts_per_tok: int = 0   # k
    moe_intermediate_size: int = 0  # F of one expert
    norm_topk_prob: bool = False   # renormalise the k routing weights (softmax_topk router)
    moe_router: str = "softmax_topk"   # "softmax_topk" (Qwen3-MoE, OLMoE) | "mixtral"
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in an MoE model (Qwen3-MoE)
    qk_norm_full: bool = False     # OLMoE: one RMSNorm over all heads of q (and of k)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-c, c]
    # Runtime layout, not from the checkpoint: how expert weights are split over a mesh
    # (moe.ExpertPartition, set by parallel/shard.py; None on one device).
    moe_partition: Any = None
    # Runtime layout, not from the checkpoint: copies of each KV head the KV cache holds
    # (> 1 only under tensor parallelism wider than the KV heads: parallel/shard.py).
    kv_head_replicas: int = 1
    # Runtime choice, not from the checkpoint: the implementation every weight is multiplied
    # by (model/linear.py; the engine picks model/cpu/matmul.py's KernelLinear on CPU,
    # unsharded, float32).
    linear: Linear = XLA_LINEAR

    @property
    def cpu_matmul(self) -> bool:
        """Whether the engine runs its C++ CPU kernels (the chosen linear's packed weights,
        the CPU decode stack, the greedy head)."""
        return self.linear.cpu_kernels

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rope_type(self) -> str:
        rs = self.rope_scaling_dict
        if not rs:
            return "default"
        return rs.get("rope_type", rs.get("type", "default"))

    def layer_kind(self, i: int) -> str:
        """Layer i's attention kind, a static argument of the layer: "sliding_attention" |
        "full_attention" (layer_types), or "default" for models without layer_types (all
        layers alike, `sliding_window` applying to each)."""
        return self.layer_types[i] if self.layer_types else "default"

    def window_of(self, kind: str) -> int | None:
        """The sliding window of a layer of this kind (None: full attention)."""
        return None if kind == "full_attention" else self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    def to_hf_dict(self) -> dict[str, Any]:
        """Inverse of from_hf_dict (enough for transformers to rebuild the model)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        if self.num_experts:
            d.update(_moe_hf_dict(self))
        if self.family in ("gemma2", "gemma3_text"):
            d = gemma.gemma_hf_dict(self, d)
        return d

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        cfg = gemma.text_config(cfg)      # Gemma 3 multimodal: its language model
        extra: dict[str, Any] = {}
        if gemma.is_gemma(cfg):
            fam = gemma.GEMMA_ARCHITECTURES.get((cfg.get("architectures") or [None])[0],
                                                cfg.get("model_type"))
            cfg, extra = gemma.gemma_fields(cfg, "gemma2" if fam == "gemma2" else "gemma3_text")
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        extra.update(_moe_fields(cfg, family))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside);
        # older config.json files have `rope_scaling` and a top-level `rope_theta`.
        rope_params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = rope_params
        if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = None
        if rope_scaling:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype not in ("default", "linear", "llama3"):
                raise UnsupportedModelError(
                    f"unsupported rope_scaling type {rtype!r} (supported: default, linear, llama3)")
            rope_scaling = tuple(sorted((k, _freeze(v)) for k, v in rope_scaling.items()))
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window",
                                                         family in ("mistral", "mixtral")) else None
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling or None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=extra.pop("qk_norm", family == "qwen3"),
            sliding_window=extra.pop("sliding_window", int(sliding) if sliding else None),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **extra,
        )

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")


def _moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The MoE / OLMoE switches of an HF config (empty for dense families)."""
    if family not in MOE_FAMILIES:
        return {}
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    out: dict[str, Any] = {
        "num_experts": int(cfg.get("num_local_experts") or cfg["num_experts"]),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size")
                                     or cfg["intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", family == "mixtral")),
        "moe_router": "mixtral" if family == "mixtral" else "softmax_topk",
        "dense_layers": dense if family == "qwen3_moe" else (),
    }
    if family == "olmoe":
        clip = cfg.get("clip_qkv")
        out.update(qk_norm_full=True, clip_qkv=float(clip) if clip is not None else None)
    if family == "qwen3_moe":
        out["qk_norm"] = True
    return out


def _moe_hf_dict(c: "ModelConfig") -> dict[str, Any]:
    """Inverse of _moe_fields (the keys of all three families; each reads its own)."""
    return {"num_local_experts": c.num_experts, "num_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(c.dense_layers), "clip_qkv": c.clip_qkv}


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _arch_from_model_type(model_type: str | None) -> str:
    for arch, fam in SUPPORTED_ARCHITECTURES.items():
        if fam == model_type:
            return arch
    raise UnsupportedModelError(f"unsupported model_type {model_type!r}")
