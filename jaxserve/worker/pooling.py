"""The runner's side of embeddings (model/pooling.py has the program and the configs).

A pooling request (SamplingParams.pooled) is scheduled like any prompt: its prompt runs
through the ordinary steps, chunked when it is longer than a step, and its last chunk
samples one token that nobody reads (max_tokens 1), which finishes it and frees its KV
blocks. After each step that has a pooling row, the runner runs the pooling program over
the step's final hidden states with one [T] int32 array saying which row each token
belongs to (S: none), and adds the row's sum into the request's accumulator when it
collects the step. When the request's last chunk is collected, the accumulator gives
the pooled vector (mean: the sum over the prompt divided by its length; last: the
final token's normed state), handed over with the request's one sampled token.

    step tokens:  | row 0: pooling, prompt pos 0..5 of 9 | row 1: decode | padding |
    rows (mean):  | 0 0 0 0 0 0                          | S             | S ...   |
    rows (last):  | S S S S S S   (pos 8 comes next step)| S             | S ...   |

A preempted request's state goes with its accumulator; it recomputes from position 0
(the scheduler gives pooling requests no prefix-cache hits: the hidden states of every
prompt token must be computed, a cached KV block does not hold them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.pooling import PoolingProgram


@dataclass(slots=True)
class PoolAccumulator:
    """One pooling request's sum of normed hidden states over the tokens pooled so far."""
    total: np.ndarray | None = None
    count: int = 0

    def add(self, row_sum: np.ndarray, count: int) -> None:
        s = np.asarray(row_sum, np.float32)
        self.total = s.copy() if self.total is None else self.total + s
        self.count += count

    def result(self) -> np.ndarray:
        """The pooled vector: the mean of what was added (last: its one token)."""
        assert self.total is not None and self.count > 0, "nothing was pooled"
        return self.total / np.float32(self.count)


@dataclass(slots=True)
class PoolRows:
    """A pooling row of one step: its state (identity is checked at collect), its row
    (the program's output row) and the tokens it pooled."""
    state: Any
    row: int
    count: int


def build_rows(batch: Any, states: Mapping[str, Any], num_rows: int, pooling_type: str
               ) -> tuple[np.ndarray, list[PoolRows]] | None:
    """Host: the step's token -> row array [T] (num_rows: not pooled) and its pooling
    rows, before the states advance; None: no pooling row in the step."""
    md = batch.md
    rows_of: np.ndarray | None = None
    rows: list[PoolRows] = []
    for r, rid in enumerate(batch.row_req_ids):
        st = states[rid]
        if st.pool is None:
            continue
        a, b = int(md.query_start_loc[r]), int(md.query_start_loc[r + 1])
        ctx = int(md.context_lens[r])
        n = min(ctx + b - a, st.num_prompt_tokens) - ctx     # prompt tokens in the chunk
        if n <= 0:
            continue
        if pooling_type == "mean":
            first, count = a, n
        elif ctx + n == st.num_prompt_tokens:                # the chunk ends the prompt
            first, count = a + n - 1, 1
        else:
            continue
        if rows_of is None:
            rows_of = np.full(batch.tokens.shape[0], num_rows, np.int32)
        rows_of[first:first + count] = r
        rows.append(PoolRows(st, r, count))
    return None if rows_of is None else (rows_of, rows)



class StepPooler:
    """The runner's embedding machinery: the pooling program (model/pooling.py) and the
    host bookkeeping above, so the runner only calls it at three points: after
    launching a step (launch), when collecting it (add), and at warm-up (compile)."""

    def __init__(self, cfg: Any, pooling_type: str, num_rows: int, on_trace: Any, *,
                 hidden_sharding: Any = None, input_sharding: Any = None) -> None:
        """num_rows: the most rows a step has (max_num_seqs); the shardings: where the
        step's hidden states and its inputs live (None: one device)."""
        self.pooling_type, self.num_rows = pooling_type, num_rows
        self._hidden_sharding, self._input_sharding = hidden_sharding, input_sharding
        self.program = PoolingProgram(
            cfg, num_rows, on_trace,
            jit_kwargs={"out_shardings": hidden_sharding} if hidden_sharding is not None
            else None)

    def launch(self, batch: Any, states: Mapping[str, Any], head: dict, hidden: Any
               ) -> tuple[Any, list[PoolRows]] | None:
        """Run the program over a launched step's hidden states if it has a pooling row
        -> (device row sums [S, D], its PoolRows), or None."""
        found = build_rows(batch, states, self.num_rows, self.pooling_type)
        if found is None:
            return None
        rows = jax.device_put(found[0], self._input_sharding)
        return self.program(head, hidden, rows), found[1]

    @staticmethod
    def add(rows: list[PoolRows], sums: np.ndarray, states: Mapping[str, Any]) -> None:
        """Add a collected step's row sums (host) into the accumulators of the requests
        still running as they were (a preempted one starts over)."""
        for r in rows:
            st = r.state
            if states.get(st.req_id) is st and st.pool is not None:
                st.pool.add(sums[r.row], r.count)

    def compile(self, t: int, head: dict, embed: Any) -> None:
        """The program for token bucket T (its hidden states come from a step of it)."""
        hidden = jax.ShapeDtypeStruct((t, embed.shape[1]), embed.dtype,
                                      sharding=self._hidden_sharding)
        rows = jax.ShapeDtypeStruct((t,), jnp.int32, sharding=self._input_sharding)
        self.program.compile(head, hidden, rows)
