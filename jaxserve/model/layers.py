"""Small pure building blocks of the decoder: RMSNorm, RoPE (with scaling), SwiGLU MLP.
Their weights are multiplied by the linear implementation they are given
(model/linear.py)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import lora
from jaxserve.model.config import ModelConfig
from jaxserve.model.linear import XLA_LINEAR, Linear


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x [..., D] normalised in float32, scaled by (offset + w) [D] (Gemma: offset 1, added
    in float32 as transformers does); returns x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = w.astype(jnp.float32) + offset if offset else w.astype(jnp.float32)
    return (xf * scale).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """[H/2] inverse frequencies, including the `linear` and `llama3` scalings.
    local: those of sliding-window layers with their own base (Gemma 3's
    rope_local_theta; unscaled)."""
    H = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    rs = {} if local else (cfg.rope_scaling_dict or {})
    rtype = "default" if local else cfg.rope_type
    if rtype == "linear":
        inv = inv / float(rs["factor"])
    elif rtype == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [T, heads, H] rotated by positions [T] (HF's rotate-half convention)."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]      # [T, H/2]
    cos = jnp.cos(ang)[:, None, :]
    sin = jnp.sin(ang)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def mlp(x: jax.Array, layer: dict, linear: Linear = XLA_LINEAR,
        act: str = "silu", lora_slots: jax.Array | None = None) -> jax.Array:
    """SwiGLU (act "silu") or GeGLU with the tanh-approximate GELU (act "gelu_tanh",
    Gemma's gelu_pytorch_tanh): x [T, D] -> [T, D]. lora_slots [T]: each token's adapter
    slot, where the layer carries adapters (model/lora.py)."""
    gate, up = linear.many(x, [layer["w_gate"], layer["w_up"]])
    if "lora" in layer:
        gate = lora.add_delta(gate, x, layer, "w_gate", lora_slots)
        up = lora.add_delta(up, x, layer, "w_up", lora_slots)
    g = jax.nn.gelu(gate, approximate=True) if act == "gelu_tanh" else jax.nn.silu(gate)
    h = g * up
    return lora.add_delta(linear(h, layer["w_down"]), h, layer, "w_down", lora_slots)
