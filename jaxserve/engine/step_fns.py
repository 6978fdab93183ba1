"""The device step, in two compiled forms with one signature:

    step(weights, kv, tokens, md, sampling, sampler_state, key) -> (out, kv', sampler_state')

* FusedStep: the whole step (all layers, logits, sampler) is one jitted function.
  Best where dispatch is expensive and XLA can overlap layers (GPU/TPU).
* LayerwiseStep: one jitted *layer* called in a Python loop over the per-layer weights
  and KV buffers, plus a jitted embedding and a jitted head (logits + sampler). Every
  layer has the same shapes, so a bucket compiles one layer instead of num_layers
  unrolled copies: XLA:CPU compile time falls ~num_layers-fold (each KV scatter alone
  costs ~0.1-0.3 s to compile), at ~30 extra dispatches (~1 ms) per step.
Both donate the KV buffers and the sampler state; both count traces (= compilations).
With a sharding plan both pin their output shardings (plan.step_jit_kwargs /
plan.layerwise_jit_kwargs), so every call sees the shardings of the first.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from jaxserve.engine import sampling_glue
from jaxserve.model import decoder


class FusedStep:
    def __init__(self, cfg: Any, inv_freq: Any, attn_fn: Any, num_logprobs: int,
                 on_trace: Callable[[], None], jit_kwargs: dict | None = None) -> None:
        self.cfg, self.inv_freq, self.attn_fn = cfg, inv_freq, attn_fn
        self.num_logprobs, self.on_trace = num_logprobs, on_trace
        self._fn = jax.jit(self._impl, donate_argnames=("kv", "sampler_state"),
                           **(jit_kwargs or {}))

    def _impl(self, weights, kv, tokens, md, sampling, sampler_state, key):
        self.on_trace()
        hidden, kv = decoder.forward(weights, kv, tokens, md, self.cfg, self.inv_freq,
                                     self.attn_fn)
        logits = decoder.compute_logits(weights, hidden[md.logits_indices])
        out, sampler_state = sampling_glue.sample(logits, sampling, sampler_state, key,
                                                  num_logprobs=self.num_logprobs)
        return out, kv, sampler_state

    def __call__(self, weights, kv, tokens, md, sampling, sampler_state, key):
        return self._fn(weights, kv, tokens, md, sampling, sampler_state, key)

    def compile(self, weights, kv, tokens, md, sampling, sampler_state, key) -> None:
        """Compile this input shape ahead of time (nothing runs, nothing is donated);
        later calls with the same shapes find it in jit's cache."""
        self._fn.lower(weights, kv, tokens, md, sampling, sampler_state, key).compile()


class LayerwiseStep:
    def __init__(self, cfg: Any, inv_freq: Any, attn_fn: Any, num_logprobs: int,
                 on_trace: Callable[[], None], jit_kwargs: dict | None = None) -> None:
        """jit_kwargs: {"embed"|"layer"|"head": kwargs} (a sharding plan pins each
        function's output shardings, so every call sees the same ones: no recompiles)."""
        self.cfg, self.inv_freq, self.attn_fn = cfg, inv_freq, attn_fn
        self.num_logprobs, self.on_trace = num_logprobs, on_trace
        kw = jit_kwargs or {}
        self._x_sharding = kw.get("embed", {}).get("out_shardings")
        self._embed = jax.jit(self._embed_impl, **kw.get("embed", {}))
        self._layer = jax.jit(self._layer_impl, donate_argnums=(1, 2), **kw.get("layer", {}))
        self._head = jax.jit(self._head_impl, donate_argnames=("sampler_state",),
                             **kw.get("head", {}))

    def _embed_impl(self, embed, tokens):
        self.on_trace()
        return embed[tokens]

    def _layer_impl(self, layer, k, v, x, md):
        self.on_trace()
        return decoder.decoder_layer(x, layer, k, v, md, self.cfg, self.inv_freq, self.attn_fn)

    def _head_impl(self, head, x, logits_indices, sampling, sampler_state, key):
        self.on_trace()
        h = decoder.rms_norm(x[logits_indices], head["final_norm"], self.cfg.rms_norm_eps)
        logits = decoder.compute_logits(head, h)
        return sampling_glue.sample(logits, sampling, sampler_state, key,
                                    num_logprobs=self.num_logprobs)

    def __call__(self, weights, kv, tokens, md, sampling, sampler_state, key):
        x = self._embed(weights["embed"], tokens)
        new_kv = []
        for layer, (k, v) in zip(weights["layers"], kv):
            x, k, v = self._layer(layer, k, v, x, md)
            new_kv.append((k, v))
        out, sampler_state = self._head(_head_weights(weights), x, md.logits_indices, sampling,
                                        sampler_state, key)
        return out, new_kv, sampler_state

    def compile(self, weights, kv, tokens, md, sampling, sampler_state, key) -> None:
        """Compile the embedding, one layer and the head for these shapes ahead of time
        (nothing runs, nothing is donated); later calls find them in jit's cache."""
        embed = weights["embed"]
        x = jax.ShapeDtypeStruct((tokens.shape[0], embed.shape[1]), embed.dtype,
                                 sharding=self._x_sharding)
        self._embed.lower(embed, tokens).compile()
        k, v = kv[0]
        self._layer.lower(weights["layers"][0], k, v, x, md).compile()
        self._head.lower(_head_weights(weights), x, md.logits_indices, sampling, sampler_state,
                         key).compile()


def _head_weights(weights: dict) -> dict:
    """What the head needs: final norm, embedding (tied head) and lm_head if untied."""
    return {k: weights[k] for k in ("final_norm", "embed", "lm_head") if k in weights}
