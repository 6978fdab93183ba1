"""When a step's decoder layers run as one C++ call on CPU (kernels_cpu/decode_stack)
instead of XLA's program of per-layer kernel calls and elementwise thunks.

At batch 1 a decode step is bound by streaming the weights from memory; in XLA's program
each of the default model's 30 layers was 5 kernel calls (q/k/v, attention, o, gate/up,
down), each a round on XLA's thread pool, and ~5 small elementwise thunks (RMSNorm, RoPE,
residual adds, SiLU), each split over the pool too: time beyond the streaming time that
the stack kernel removes (docs/benchmarks.md, "CPU kernels"). The stack kernel keeps its threads
for all layers, so the weights stream back to back.

Taken, at trace time, when all of these hold (else the layers stay XLA's, unchanged):
- the step has at most SMALL_STEP_TOKENS tokens (its bucket, static): the fused step's small
  decode buckets; larger buckets are bound by compute, not by these overheads;
- the engine runs the CPU kernels (ModelConfig.cpu_matmul) and the CPU attention backend;
- the model is a plain Llama-style stack: every layer's seven projections packed
  (model/cpu/matmul.py), all float32 (PackedWeight) or all quantized (QPackedWeight: the
  kernel streams the same quantized panels as the layerwise path), RMSNorm without offset, SwiGLU, RoPE, no biases, q/k norms,
  clipping, sandwich norms, soft caps, sliding windows, experts or KV replicas;
- the caches are float32 (not quantized).
The kernel computes what decoder.layers_forward does, with the same packed-panel matmul
and attention work item as the layerwise path: outputs agree to float32 rounding (the
norms' sums run in another order), tests/kernels/test_cpu_stack.py.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.model.config import ModelConfig
from jaxserve.model.cpu import SMALL_STEP_TOKENS
from jaxserve.model.cpu.matmul import PACKED_KEYS, PackedWeight, QPackedWeight

# a layer's arguments of the kernel, in its order (kernels_cpu/decode_stack/kernel.py)
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def _plain_llama(cfg: ModelConfig) -> bool:
    return (cfg.cpu_matmul and not cfg.attention_bias and not cfg.qk_norm
            and not cfg.qk_norm_full and cfg.clip_qkv is None and not cfg.sandwich_norms
            and cfg.norm_offset == 0.0 and cfg.hidden_act == "silu"
            and cfg.attn_logit_softcap is None and cfg.sliding_window is None
            and cfg.layer_types is None and cfg.num_experts == 0
            and cfg.kv_head_replicas == 1)


def usable(weights: dict[str, Any], kv: list, num_tokens: int, cfg: ModelConfig,
           attn_fn: Any) -> bool:
    """Trace-time check (see the module doc)."""
    if num_tokens > SMALL_STEP_TOKENS or not _plain_llama(cfg) or not weights["layers"]:
        return False        # (cfg.cpu_matmul is False on GPU / TPU: nothing CPU imported)
    from jaxserve.attention import cpu_backend
    if attn_fn is not cpu_backend.paged_attention:
        return False
    kind = type(weights["layers"][0].get("wq"))
    if kind not in (PackedWeight, QPackedWeight):
        return False
    for layer, (k, v) in zip(weights["layers"], kv):
        if not all(type(layer.get(key)) is kind for key in PACKED_KEYS):
            return False
        if set(layer) - set(LAYER_KEYS):
            return False            # biases, extra norms, a router: not this kernel's
        for a in (k, v, layer["attn_norm"], layer["mlp_norm"]):
            if not isinstance(a, jax.Array) or a.dtype != jnp.float32:
                return False        # a quantized cache (QuantizedKV) or other dtypes
    return True


def _kernel_args(w: Any) -> Any:
    """A layer entry as the kernel takes it: panels, (q, scale, offset) or the array."""
    if isinstance(w, PackedWeight):
        return w.panels
    if isinstance(w, QPackedWeight):
        return (w.q, w.scale, w.offset)
    return w


def layers_forward(weights: dict[str, Any], kv: list, x: jax.Array, md: AttentionMetadata,
                   cfg: ModelConfig, inv_freq: jax.Array) -> tuple[jax.Array, list]:
    """decoder.layers_forward after the embedding, as one kernel call: x [T, D] (the
    embedded tokens) -> (the last layer's output [T, D], the updated caches)."""
    from kernels_cpu.decode_stack.kernel import decode_stack
    ang = md.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]     # as apply_rope
    layers = [tuple(_kernel_args(layer[key]) for key in LAYER_KEYS)
              for layer in weights["layers"]]
    out, new_kv = decode_stack(x.astype(jnp.float32), jnp.cos(ang), jnp.sin(ang),
                               md.slot_mapping, md.query_start_loc, md.seq_lens,
                               md.block_tables, layers, list(kv), eps=cfg.rms_norm_eps,
                               scale=cfg.attention_scale,
                               int8_acts=getattr(cfg.linear, "int8_activations", False))
    return out.astype(x.dtype), new_kv
