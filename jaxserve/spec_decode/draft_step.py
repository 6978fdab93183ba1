"""The device drafter's two jitted programs (host side: spec_decode/draft.py).

    propose(weights, kv, packed) -> (proposals [k, R] int32, kv')     kv donated
        k one-token steps (spec_decode/draft_inputs.py) under one lax.scan: step i's
        greedy token is step i+1's input, so the k steps are one dispatch and the
        host waits once, for k * R ints.
    mirror(weights, kv, packed, last_tokens) -> kv'                   kv donated
        draft_model only: the draft's layers over the target step's own batch
        (same tokens, positions and slots: the draft's pool shares the target's
        block ids), so the draft's KV holds every position the target computes --
        prompt chunks, decodes, verified tokens -- without a catch-up pass.

`weights` is a decoder weight tree (embed, layers, final_norm, lm_head if untied): the
draft checkpoint's, or for self-speculation the target's first L layers with its own
norm and head. With a sharding plan the KV outputs are pinned to the input KV's
shardings (and proposals replicated), so the target's step sees the same shardings
every call: no recompiles.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from jaxserve.engine.packing import Packed
from jaxserve.engine.step_fns import _fed_tokens
from jaxserve.model import decoder
from jaxserve.sampling.sampler import argmax_last


class DraftPrograms:
    def __init__(self, cfg: Any, inv_freq: Any, attn_fn: Any, on_trace: Callable[[], None],
                 kv_shardings: Any = None, replicated: Any = None) -> None:
        self.cfg, self.inv_freq, self.attn_fn, self.on_trace = cfg, inv_freq, attn_fn, on_trace
        pk = dict(out_shardings=(replicated, kv_shardings)) if kv_shardings is not None else {}
        mk = dict(out_shardings=kv_shardings) if kv_shardings is not None else {}
        self.propose = jax.jit(self._propose_impl, donate_argnames=("kv",), **pk)
        self.mirror = jax.jit(self._mirror_impl, donate_argnames=("kv",), **mk)

    def _propose_impl(self, weights: dict, kv: Any, packed: Packed) -> tuple[Any, Any]:
        self.on_trace()
        tokens0, mds = packed.unpack("draft")

        def one(carry, md):
            kv, tokens = carry              # tokens [R]: one per row (T = R)
            hidden, kv = decoder.forward(weights, kv, tokens, md, self.cfg, self.inv_freq,
                                         self.attn_fn)
            logits = decoder.compute_logits(weights, hidden, self.cfg.cpu_matmul,
                                            self.cfg.final_logit_softcap)
            nxt = argmax_last(logits)       # XLA:CPU's wide argmax is ~30x slower
            return (kv, nxt), nxt
        (kv, _), proposals = jax.lax.scan(one, (kv, tokens0), mds)
        return proposals, kv

    def _mirror_impl(self, weights: dict, kv: Any, packed: Packed, last: Any) -> Any:
        self.on_trace()
        tokens, md = packed.unpack("batch")
        tokens = _fed_tokens(tokens, packed, last)
        _, kv = decoder.forward(weights, kv, tokens, md, self.cfg, self.inv_freq, self.attn_fn)
        return kv
