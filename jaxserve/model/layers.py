"""Small pure building blocks of the decoder: RMSNorm, RoPE (with scaling), SwiGLU MLP,
and the one matmul helper every weight goes through (float or quantized; on CPU, decode-
sized float32 matmuls may take the C++ small-M kernel: model/cpu/matmul.py)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.cpu import matmul as cpu_matmul
from jaxserve.model.config import ModelConfig
from jaxserve.model.quant import QArray, matmul


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


def mlp(x: jax.Array, layer: dict, cpu_kernel: bool = False, act: str = "silu") -> jax.Array:
    """SwiGLU (act "silu") or GeGLU with the tanh-approximate GELU (act "gelu_tanh",
    Gemma's gelu_pytorch_tanh): x [T, D] -> [T, D]."""
    gate, up = linear_many(x, [layer["w_gate"], layer["w_up"]], cpu_kernel)
    g = jax.nn.gelu(gate, approximate=True) if act == "gelu_tanh" else jax.nn.silu(gate)
    return linear(g * up, layer["w_down"], cpu_kernel)


def linear(x: jax.Array, w: jax.Array | QArray, cpu_kernel: bool = False) -> jax.Array:
    """x [..., in] times a projection: a float [in, out] array (x @ w), or a QArray in
    HF orientation [out, in] (dequantized inside the step; see model/quant.py).
    cpu_kernel (ModelConfig.cpu_matmul): decode-sized float32 x @ w runs the C++ kernel."""
    if isinstance(w, QArray):
        return matmul(x, w)
    if isinstance(w, cpu_matmul.PackedWeight):       # packed for the C++ kernel, any rows
        return _packed(x, [w])[0]
    if cpu_kernel and cpu_matmul.fits(x, w):
        return cpu_matmul.matmul(x, w)
    return x @ w


def _packed(x: jax.Array, ws: list) -> list[jax.Array]:
    """x [..., K] against packed weights (model/cpu/matmul.py), x cast to float32."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    ys = cpu_matmul.packed_matmul_many(x2, ws)
    return [y.reshape(*lead, y.shape[-1]).astype(x.dtype) for y in ys]


def linear_many(x: jax.Array, ws: list, cpu_kernel: bool = False) -> list[jax.Array]:
    """[linear(x, w) for w in ws]; on the C++ kernel's path (decode-sized float32) in one
    call for all of them (one thread-pool round instead of one per weight)."""
    if len(ws) <= 4 and all(isinstance(w, cpu_matmul.PackedWeight) for w in ws):
        return _packed(x, ws)
    if cpu_kernel and len(ws) > 1 and all(cpu_matmul.fits(x, w) for w in ws):
        return cpu_matmul.matmul_many(x, ws)
    return [linear(x, w, cpu_kernel) for w in ws]


def tied_head(x: jax.Array, embed: jax.Array | QArray, cpu_kernel: bool = False) -> jax.Array:
    """x [R, D] against a tied embedding [V, D] -> [R, V]."""
    if isinstance(embed, QArray):
        return matmul(x, embed)
    if cpu_kernel and cpu_matmul.fits(x, embed):
        return cpu_matmul.matmul_t(x, embed)
    return x @ embed.T
