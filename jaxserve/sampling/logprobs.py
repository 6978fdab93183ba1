"""Logprobs of the sampled tokens and their top alternatives.

What is reported (vLLM v1's default `logprobs_mode="raw_logprobs"`, and OpenAI's): the
log-softmax of the model's raw logits, before logit_bias, min_tokens, penalties,
temperature and top-k/top-p/min-p. So a greedy and a sampled request see the same
numbers for the same context, and logprobs describe the model, not the sampler.

Ranks are 1-based: the sampled token's rank is the number of tokens at least as likely
(vLLM's definition); the i-th alternative has rank i.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.request import Logprob


def compute_logprobs(raw_logits: jax.Array, token_ids: jax.Array, num_logprobs: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """raw_logits [R, V] f32, token_ids [R] -> (logprobs [R, n+1], their ids [R, n+1],
    rank of the sampled token [R]); column 0 is the sampled token, then the top n."""
    lse = jax.nn.logsumexp(raw_logits, axis=1, keepdims=True)
    tok = jnp.take_along_axis(raw_logits, token_ids[:, None], axis=1)          # [R, 1]
    rank = jnp.sum(raw_logits >= tok, axis=1).astype(jnp.int32)
    vals, ids = tok, token_ids[:, None].astype(jnp.int32)
    if num_logprobs > 0:
        top_vals, top_ids = jax.lax.top_k(raw_logits, num_logprobs)
        # keep XLA's TopK kernel (see truncation.py); one barrier per output
        top_vals = jax.lax.optimization_barrier(top_vals)
        top_ids = jax.lax.optimization_barrier(top_ids)
        vals = jnp.concatenate([vals, top_vals], axis=1)
        ids = jnp.concatenate([ids, top_ids.astype(jnp.int32)], axis=1)
    return vals - lse, ids, rank


def logprob_dict(logprobs: np.ndarray, token_ids: np.ndarray, rank: int, num: int
                 ) -> dict[int, Logprob]:
    """Host: one row ([n+1] arrays, numpy) -> vLLM's {token_id: Logprob} with the
    sampled token and the top `num` (<= n) alternatives."""
    out = {int(token_ids[0]): Logprob(float(logprobs[0]), int(rank))}
    for i in range(1, num + 1):
        out.setdefault(int(token_ids[i]), Logprob(float(logprobs[i]), i))
    return out
