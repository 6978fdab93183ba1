"""Our weights back in HF layout (for the transformers reference and benchmarks)."""
from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.cpu.matmul import PackedWeight, PanelEmbedding, QPackedWeight
from jaxserve.model.params import iter_specs, param_specs
from jaxserve.model.quant import QArray


def to_hf_state_dict(cfg: ModelConfig, weights: Any, keep_quantized: bool = False
                     ) -> dict[str, Any]:
    """{HF tensor name: float32 numpy array} for every parameter (lm_head when tied);
    keep_quantized: a QArray stays one (numpy parts; it is in HF orientation already)."""
    out: dict[str, Any] = {}
    for path, spec in iter_specs(param_specs(cfg)):
        node = weights
        for k in path:
            node = node[k.key if hasattr(k, "key") else k.idx]
        if isinstance(node, (PackedWeight, QPackedWeight, PanelEmbedding)):
            # the CPU kernel's layouts (model/cpu/matmul.py)
            node = node.unpacked()
        if isinstance(node, QArray):
            if keep_quantized:
                out[spec.hf_name] = node.map_parts(lambda _, p: np.asarray(p))
                continue
            node = node.dequantize(np.float32)
        a = np.asarray(node, np.float32)
        out[spec.hf_name] = np.ascontiguousarray(a.T if spec.hf_transpose else a)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def to_transformers(cfg: ModelConfig, weights: Any) -> Any:
    """A transformers causal LM (float32, eval mode) carrying exactly these weights."""
    import torch
    import transformers
    hf_cfg = transformers.AutoConfig.for_model(cfg.family, **{
        k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    state = {k: torch.from_numpy(v.copy()) for k, v in to_hf_state_dict(cfg, weights).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    return model.eval()
