"""The device drafter's two jitted programs (host side: worker/drafter/draft.py).

    propose(weights, kv, packed, penalties, draft_probs, base_key)
            -> (proposals [k, R] int32, kv', draft_probs')          kv, draft_probs donated
        k one-token steps (worker/drafter/draft_inputs.py) under one lax.scan: step i's
        token is step i+1's input, so the k steps are one dispatch and the host waits
        once, for k * R ints. Greedy and seeded rows propose the draft's argmax (seeded:
        so their emitted tokens stay plain decoding's). Unseeded sampled rows draw
        d_{i+1} from q_i, the distribution the sampler would draw from the draft's logits
        under the request's own controls (rejection_general.sampling_probs: bias,
        min_tokens, penalties counting d_1..d_i as outputs, temperature, top-k/p,
        min-p), with the uniforms rejection_general.draft_uniforms gives the row's key,
        and write q_i into draft_probs[slot, i], where the verifying step reads it.
    mirror(weights, kv, packed, last_tokens) -> kv'                   kv donated
        draft_model only: the draft's layers over the target step's own batch
        (same tokens, positions and slots: the draft's pool shares the target's
        block ids), so the draft's KV holds every position the target computes --
        prompt chunks, decodes, verified tokens -- without a catch-up pass.

Keys: the row's key is row_keys(seed, output position of its first proposal, the
step's key fold_in(base_key, step)), the key its verification uses
(rejection_general: "Randomness").

`weights` is a decoder weight tree (embed, layers, final_norm, lm_head if untied): the
draft checkpoint's, or for self-speculation the target's first L layers with its own
norm and head. With a sharding plan the KV outputs are pinned to the input KV's
shardings (proposals and q replicated), so the target's step sees the same shardings
every call: no recompiles. branch=False (GPU, sampler.py: no data-dependent
conditionals) runs the sampled path for every step, greedy or not, with the exact
threshold search: one program per shape.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.worker.packing import Packed
from jaxserve.worker.step_programs import fed_tokens
from jaxserve.model import decoder
from jaxserve.sampling.sampler import BRANCHED, SamplerPlan, argmax_last
from jaxserve.sampling.rejection_general import (draft_uniforms, draw, row_keys,
                                                 sampling_probs)


class DraftPrograms:
    def __init__(self, cfg: Any, inv_freq: Any, attn_fn: Any, on_trace: Callable[[], None],
                 kv_shardings: Any = None, replicated: Any = None, *, branch: bool = True,
                 sample_drafts: bool = True) -> None:
        """sample_drafts=False: every row proposes its argmax with a one-hot q (exact as
        well; a baseline that shows what sampling from q gains)."""
        self.cfg, self.inv_freq, self.attn_fn, self.on_trace = cfg, inv_freq, attn_fn, on_trace
        self.plan = BRANCHED if branch else SamplerPlan(False, sample=True, exact=True)
        self.sample_drafts = sample_drafts
        pk = (dict(out_shardings=(replicated, kv_shardings, replicated))
              if kv_shardings is not None else {})
        mk = dict(out_shardings=kv_shardings) if kv_shardings is not None else {}
        self.propose = jax.jit(self._propose_impl, donate_argnames=("kv", "draft_probs"),
                               **pk)
        self.mirror = jax.jit(self._mirror_impl, donate_argnames=("kv",), **mk)

    def _propose_impl(self, weights: dict, kv: Any, packed: Packed, penalties: Any,
                      draft_probs: jax.Array, base_key: jax.Array
                      ) -> tuple[Any, Any, jax.Array]:
        self.on_trace()
        tokens0, mds = packed.unpack("draft")
        md, slots, step = packed.unpack("sampling")
        k = draft_probs.shape[1]
        u = draft_uniforms(row_keys(md.seed, md.has_seed, md.output_pos,
                                    jax.random.fold_in(base_key, step)), k)     # [R, k]

        def one(carry, xs):
            kv, tokens, prev, q_buf = carry     # tokens [R]: one per row (T = R)
            amd, i = xs
            hidden, kv = decoder.forward(weights, kv, tokens, amd, self.cfg, self.inv_freq,
                                         self.attn_fn)
            logits = decoder.compute_logits(weights, hidden, self.cfg.linear,
                                            self.cfg.final_logit_softcap)
            best = argmax_last(logits)          # XLA:CPU's wide argmax is ~30x slower
            nxt, q = self._sampled(logits, best, md, i, prev, penalties, slots, u[:, i])
            q_buf = q_buf.at[slots, i].set(q)
            prev = prev.at[:, i].set(nxt)       # d_{i+1}: an output for step i+1's penalties
            return (kv, nxt, prev, q_buf), nxt
        prev0 = jnp.full((tokens0.shape[0], k), self.cfg.vocab_size, jnp.int32)
        (kv, _, _, draft_probs), proposals = jax.lax.scan(
            one, (kv, tokens0, prev0, draft_probs), (mds, jnp.arange(k)))
        return proposals, kv, draft_probs

    def _sampled(self, logits: jax.Array, best: jax.Array, md: Any, i: jax.Array,
                 prev: jax.Array, penalties: Any, slots: jax.Array, u: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
        """(token [R], q [R, V]) of draft step i: greedy and seeded rows their argmax
        (q one-hot), unseeded sampled rows a draw from q_i. Seeded rows keep argmax
        drafting and matching (in_step._verify_drafted): each token they emit is
        then the target's own draw with that position's seeded uniform, the token plain
        decoding gives, so neither the schedule nor a prefix-cache hit can change it."""
        def one_hot() -> tuple[jax.Array, jax.Array]:
            return best, jax.nn.one_hot(best, logits.shape[1], dtype=jnp.float32)
        if not self.sample_drafts:
            return one_hot()

        def sampled() -> tuple[jax.Array, jax.Array]:
            md_i = dataclasses.replace(md, output_pos=md.output_pos + i, prev_draft_ids=prev)
            q = sampling_probs(logits, md_i, penalties, slots, plan=self.plan)
            return jnp.where((md.temperature > 0) & ~md.has_seed, draw(q, u), best), q
        if self.plan.branch:
            return jax.lax.cond(md.all_greedy, one_hot, sampled)
        return sampled()

    def _mirror_impl(self, weights: dict, kv: Any, packed: Packed, last: Any) -> Any:
        self.on_trace()
        tokens, md = packed.unpack("batch")
        tokens = fed_tokens(tokens, packed, last)
        _, kv = decoder.forward(weights, kv, tokens, md, self.cfg, self.inv_freq, self.attn_fn)
        return kv
