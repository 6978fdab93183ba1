"""The device step as jitted groups of layers, and beside the fused step by bucket size
(same signature as worker/step_programs.py's FusedStep):

* LayerwiseStep: jitted groups of layers (one layer, or all of them for small steps:
  layers_per_call) called in a Python loop over the per-layer weights and KV buffers,
  plus a jitted embedding, a jitted head (final norm + logits) and the sampler as its
  own program. A one-layer group has the same shapes at every layer, so a bucket
  compiles one layer instead of num_layers unrolled copies: XLA:CPU compile time falls
  ~num_layers-fold (each KV scatter is costly to compile), at one extra dispatch per
  layer per step. The sampler program depends on the row count only, so the buckets at
  or above max_num_seqs rows share one (the sampler is most of a bucket's compile on the
  default model; docs/benchmarks.md, "Measurements behind code choices").
* HybridStep: the fused step for buckets of at most max_fused_tokens tokens (decode at
  small batch, where a step is a few milliseconds and every program launch shows), the
  layerwise step above them (where compile time would grow with the layers). Only the
  small buckets pay the fused compile.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import jax

from jaxserve.model import decoder
from jaxserve.sampling.in_step import StepPlan
from jaxserve.worker.executables import ExecutableStore, Program
from jaxserve.worker.packing import Packed
from jaxserve.worker.step_programs import (FusedStep, SamplerProgram, bucket_tokens,
                                           committed_to, fed_tokens, head_weights,
                                           sampler_rows, split_state)


class LayerwiseStep:
    def __init__(self, cfg: Any, inv_freq: Any, attn_fn: Any, num_logprobs: int,
                 on_trace: Callable[[], None], jit_kwargs: dict | None = None,
                 layers_per_call: Callable[[int], int] = lambda tokens: 1,
                 store: ExecutableStore | None = None) -> None:
        """jit_kwargs: {"embed"|"layer"|"head": kwargs} (a sharding plan pins each
        function's output shardings, so every call sees the same ones: no recompiles).
        layers_per_call(bucket tokens) -> G: G consecutive layers run in one jitted call
        (G unrolled layers per compile, num_layers / G calls per step; a shorter last
        group compiles once more). Small steps gain most from fewer calls."""
        self.cfg, self.inv_freq, self.attn_fn = cfg, inv_freq, attn_fn
        self.num_logprobs, self.on_trace = num_logprobs, on_trace
        self.last_hidden: Any = None
        self.layers_per_call = layers_per_call
        kw = jit_kwargs or {}
        self._x_sharding = kw.get("embed", {}).get("out_shardings")
        self._layer_kw = dict(kw.get("layer", {}))
        self._store = store
        self._groups: dict[int, Program] = {}   # group length -> its jitted function
        self._groups_lock = threading.Lock()
        # (first, end) layer of a group -> its dispatch class: (length, kinds, tree)
        self._span_class: dict[tuple[int, int], Any] = {}
        self._embed = Program(jax.jit(self._embed_impl, **kw.get("embed", {})), "embed", store)
        # the head ends at the logits; the sampler is its own program, keyed by the row
        # count only, so token buckets with the same rows (every bucket >= max_num_seqs)
        # share one: compiling the sampler is most of a bucket's compile time
        head_kw = dict(kw.get("head", {}))
        outs = head_kw.get("out_shardings")         # (out, sampler_state)
        self._rep = outs[0] if outs is not None else None
        logits_kw = dict(head_kw, out_shardings=(self._rep, self._rep)) if outs else head_kw
        self._head = Program(jax.jit(self._head_impl, **logits_kw), "head", store)
        self._sampler = SamplerProgram(num_logprobs, on_trace, head_kw, store)

    def _group_fn(self, g: int) -> Any:
        """The jitted call of g consecutive layers (built once per length; warm-up
        compiles shapes from several threads)."""
        with self._groups_lock:
            if g not in self._groups:
                kw = dict(self._layer_kw)
                if "out_shardings" in kw:       # (x, k, v) of one layer -> (x, ks, vs) of g
                    x_s, k_s, v_s = kw["out_shardings"]
                    kw["out_shardings"] = (x_s, (k_s,) * g, (v_s,) * g)
                # kinds (cfg.layer_kind of each layer: Gemma's sliding / full) are static:
                # one compile per distinct run of kinds, not per layer
                self._groups[g] = Program(
                    jax.jit(self._group_impl, donate_argnums=(1, 2),
                            static_argnames=("kinds",), **kw), f"layers{g}", self._store,
                    donate=(1, 2))
            return self._groups[g]

    def _class(self, weights: Any, a: int, b: int) -> Any:
        """Layers a..b's dispatch class (spans of one class share a program)."""
        c = self._span_class.get((a, b))
        if c is None:
            c = self._span_class[(a, b)] = (b - a, self._kinds(a, b), jax.tree_util.tree_structure(
                tuple(weights["layers"][a:b])))
        return c

    def _embed_impl(self, embed, packed, last=None):
        self.on_trace()
        tokens, _ = packed.unpack("batch")
        return decoder.embed_tokens(embed, fed_tokens(tokens, packed, last), self.cfg)

    def _group_impl(self, layers, ks, vs, x, packed, kinds=None):
        self.on_trace()
        _, md = packed.unpack("batch")
        md = decoder.prepare_attention(self.attn_fn, md, self.cfg)
        new_k, new_v = [], []
        for layer, k, v, kind in zip(layers, ks, vs, kinds or ("default",) * len(layers)):
            x, k, v = decoder.decoder_layer(x, layer, k, v, md, self.cfg, self.inv_freq,
                                            self.attn_fn, kind)
            new_k.append(k)
            new_v.append(v)
        return x, tuple(new_k), tuple(new_v)

    def _kinds(self, a: int, b: int) -> tuple[str, ...]:
        return tuple(self.cfg.layer_kind(i) for i in range(a, b))

    def _spans(self, tokens: int) -> list[tuple[int, int]]:
        L = self.cfg.num_layers
        G = max(1, min(self.layers_per_call(tokens), L))
        return [(i, min(i + G, L)) for i in range(0, L, G)]

    def _head_impl(self, head, x, packed):
        self.on_trace()
        _, md = packed.unpack("batch")
        h = decoder.final_norm(head, x[md.logits_indices], self.cfg)
        logits = decoder.compute_logits(head, h, self.cfg.linear,
                                        self.cfg.final_logit_softcap)
        return sampler_rows(logits, packed), packed.section("sampling")

    def __call__(self, weights, kv, packed, sampler_state, base_key, plan: StepPlan):
        x = self._embed(packed.layout, weights["embed"], packed, split_state(sampler_state)[1])
        new_kv = []
        for a, b in self._spans(bucket_tokens(packed)):
            x, ks, vs = self._group_fn(b - a)(
                (self._class(weights, a, b), packed.layout),
                tuple(weights["layers"][a:b]), tuple(k for k, _ in kv[a:b]),
                tuple(v for _, v in kv[a:b]), x, packed, kinds=self._kinds(a, b))
            new_kv.extend(zip(ks, vs))
        logits, sampling = self._head(packed.layout, head_weights(weights), x, packed)
        out, sampler_state = self._sampler(logits, sampling, sampler_state, base_key,
                                           plan=plan)
        self.last_hidden = x
        return out, new_kv, sampler_state

    def compile(self, weights, kv, packed, sampler_state, base_key,
                plans: Sequence[StepPlan]) -> None:
        """Compile the embedding, each group length and the head (every plan) for these
        shapes ahead of time (nothing runs, nothing is donated); later calls find them in
        jit's cache."""
        embed = weights["embed"]
        T = bucket_tokens(packed)
        # the embedding's output as the real step hands it on: committed (to its plan's
        # sharding, else to the weights' device; an unplaced x would compile another program)
        x = jax.ShapeDtypeStruct((T, embed.shape[1]), embed.dtype,
                                 sharding=self._x_sharding or committed_to(embed))
        self._embed.compile(packed.layout, embed, packed, split_state(sampler_state)[1])
        first = {}      # one span per (length, layer kinds, weights tree: MoE or dense MLP)
        for a, b in self._spans(T):
            first.setdefault(self._class(weights, a, b), a)
        for (g, kinds, tree), a in first.items():
            self._group_fn(g).compile(((g, kinds, tree), packed.layout),
                                      tuple(weights["layers"][a:a + g]),
                                      tuple(k for k, _ in kv[a:a + g]),
                                      tuple(v for _, v in kv[a:a + g]), x, packed,
                                      kinds=kinds)
        head = self._head.compile(packed.layout, head_weights(weights), x, packed)
        self._sampler.compile(head, packed, sampler_state, base_key, plans,
                              self._rep or committed_to(embed))


class HybridStep:
    """FusedStep for buckets of at most max_fused_tokens tokens, LayerwiseStep above
    (same signature; each compiles only the buckets it runs)."""

    def __init__(self, fused: FusedStep, layerwise: LayerwiseStep,
                 max_fused_tokens: int) -> None:
        self.fused, self.layerwise, self.max_fused_tokens = fused, layerwise, max_fused_tokens
        self.last_hidden: Any = None

    def _for(self, packed: Packed) -> Any:
        return self.fused if bucket_tokens(packed) <= self.max_fused_tokens else self.layerwise

    def __call__(self, weights, kv, packed, sampler_state, base_key, plan: StepPlan):
        step = self._for(packed)
        out = step(weights, kv, packed, sampler_state, base_key, plan)
        self.last_hidden = step.last_hidden
        return out

    def compile(self, weights, kv, packed, sampler_state, base_key,
                plans: Sequence[StepPlan]) -> None:
        self._for(packed).compile(weights, kv, packed, sampler_state, base_key, plans)
