"""Prompt logprobs (SamplingParams.prompt_logprobs): for each prompt position i >= 1,
log p(prompt[i] | prompt[:i]) and the top k alternatives, in vLLM's shape
(`RequestOutput.prompt_logprobs`: None for position 0, then one {token: Logprob} each).

The step's final hidden state at the token of position j is what predicts token j+1, so
a prompt chunk of positions ctx .. ctx+n-1 yields the entries ctx+1 .. ctx+n (capped
at the last prompt position: the hidden state there predicts the first OUTPUT token,
whose logprob is the sampler's). The last position of one chunk predicts the first
token of the next chunk, which the host knows (it is in the prompt).

    step tokens:   | row 0: pos 0..5 of a prompt of 9 | row 1 (decode) | padding |
    targets:       | p[1] p[2] p[3] p[4] p[5] p[6]    | -1             | -1 ...  |

Cost: a step with no such row runs nothing extra. A step with one runs one more jitted
program over the step's T hidden rows (head, log-softmax, the target's logprob and
rank, top k), one program per token bucket (compiled when a step of that bucket first
needs it: a one-time stall, counted in the runner's num_lazy_compiles),
and sends one extra [T] int32 array (the targets). The head runs over row chunks of at
most CHUNK rows, so the [rows, vocab] logits stay small at any bucket.

A request that wants them must compute every prompt position itself: the scheduler
gives it no prefix-cache hits (as vLLM does) until it has an output token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import decoder
from jaxserve.request import Logprob
from jaxserve.sampling.logprobs import compute_logprobs, logprob_dict

CHUNK = 256     # rows of logits at a time: [CHUNK, V] float32 (~50 MB at V = 49152)


class PromptLogprobProgram:
    """(head weights, hidden [T, D], targets [T] int32) -> logprobs [T, k+1], their
    token ids [T, k+1] (column 0: the target, then the top k), target ranks [T]."""

    def __init__(self, cfg: Any, num_logprobs: int, on_trace: Callable[[], None], *,
                 jit_kwargs: dict | None = None) -> None:
        """hidden: the last layer's output, before the final norm (what every step form
        keeps in last_hidden)."""
        self.cfg, self.k, self.on_trace = cfg, num_logprobs, on_trace
        self._fn = jax.jit(self._impl, **(jit_kwargs or {}))

    def _impl(self, head: dict, hidden: jax.Array, targets: jax.Array) -> Any:
        self.on_trace()
        T, D = hidden.shape
        c = min(T, CHUNK)
        pad = -T % c
        h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, c, D)
        t = jnp.pad(jnp.maximum(targets, 0), (0, pad)).reshape(-1, c)

        def rows(args: tuple[jax.Array, jax.Array]) -> Any:
            x, tok = args
            x = decoder.final_norm(head, x, self.cfg)
            logits = decoder.compute_logits(head, x, self.cfg.linear,
                                            self.cfg.final_logit_softcap)
            return compute_logprobs(logits, tok, self.k)
        lp, ids, rank = jax.lax.map(rows, (h, t))
        return (lp.reshape(-1, self.k + 1)[:T], ids.reshape(-1, self.k + 1)[:T],
                rank.reshape(-1)[:T])

    def __call__(self, head: dict, hidden: jax.Array, targets: jax.Array) -> Any:
        return self._fn(head, hidden, targets)

    def compile(self, head: dict, hidden: Any, targets: Any) -> None:
        """Compile for these (abstract) shapes ahead of time; nothing runs."""
        self._fn.lower(head, hidden, targets).compile()


@dataclass(slots=True)
class PromptRows:
    """Where one request's prompt-logprob entries sit in a step's targets."""
    state: Any                 # the runner's CachedRequestState (identity is checked)
    start: int                 # first step token of the row
    count: int                 # entries (positions ctx+1 .. ctx+count)
    k: int                     # top alternatives wanted


def build_targets(batch: Any, states: Mapping[str, Any]
                  ) -> tuple[np.ndarray, list[PromptRows]] | None:
    """Host: the targets [T] (-1: not wanted) of a step batch (before its states advance)
    and the rows they belong to; None: the step needs no prompt-logprob program."""
    md = batch.md
    targets: np.ndarray | None = None
    rows: list[PromptRows] = []
    for r, rid in enumerate(batch.row_req_ids):
        st = states[rid]
        if st.prompt_logprobs is None:
            continue
        a, b = int(md.query_start_loc[r]), int(md.query_start_loc[r + 1])
        ctx = int(md.context_lens[r])
        count = min(ctx + b - a, st.num_prompt_tokens - 1) - ctx
        if count <= 0:
            continue
        if targets is None:
            targets = np.full(batch.tokens.shape[0], -1, np.int32)
        targets[a:a + count] = st.token_ids[ctx + 1:ctx + 1 + count]
        rows.append(PromptRows(st, a, count, st.sampling_params.prompt_logprobs))
    return None if targets is None else (targets, rows)


def entries(out: Any, row: PromptRows) -> list[dict[int, Logprob]]:
    """Host: a row's entries from the program's fetched (numpy) outputs."""
    lp, ids, rank = out
    return [logprob_dict(lp[t], ids[t], int(rank[t]), row.k)
            for t in range(row.start, row.start + row.count)]
