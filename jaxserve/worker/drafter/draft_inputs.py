"""Host inputs of a device drafter's k one-token proposal steps (worker/drafter/draft.py).

A speculating row r has its last known token x_r at position p_r (= its
num_computed_tokens: x_r is in no cache yet) and will verify k_r <= k proposals, so the
scheduler has given it blocks up to position p_r + k_r. The draft runs k steps:

    step i     token in               position   writes KV at     proposes
    0          x_r                    p_r        slot(p_r)        d1
    i          d_i (step i-1's out)   p_r + i    slot(p_r + i)    d_{i+1}

A row with k_r < k repeats its step k_r - 1 in steps k_r..k-1 with the KV write
dropped (it has no blocks past p_r + k_r); those tokens are ignored. One token per row:
T = R (a row bucket <= max_num_seqs), so there are no query tiles. Every step has the
same block tables; each field of AttentionMetadata gets a leading [k] axis, so one
jitted program scans the k steps, and everything goes in one transfer (packing.py),
with the rows' sampling settings (draft_sampling: sampled rows draw from q).
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.worker.buckets import BucketSet
from jaxserve.worker.packing import Packed, pack
from jaxserve.sampling.metadata import SamplingMetadata, build_sampling_metadata


@dataclass(frozen=True, slots=True)
class DraftRow:
    slot: int        # the request's persistent slot (block-table row)
    pos: int         # p: position of its last known token
    token: int       # x: that token
    k: int           # proposals it verifies (1..k)


@dataclass(frozen=True, slots=True)
class DraftShapes:
    """The compiled shapes of the proposal program: rows R x block-table width P."""
    rows: tuple[int, ...]
    widths: tuple[int, ...]

    @classmethod
    def from_buckets(cls, buckets: BucketSet) -> "DraftShapes":
        m = buckets.max_num_seqs
        rows = tuple(sorted({b for b in buckets.token_buckets if b < m} | {m}))
        # a drafting row always has context (its prompt): width 0 is never needed
        widths = tuple(p for p in buckets.block_buckets if p > 0) or buckets.block_buckets
        return cls(rows, widths)

    def pick(self, num_rows: int, num_blocks: int) -> tuple[int, int]:
        return (self.rows[bisect.bisect_left(self.rows, num_rows)],
                self.widths[bisect.bisect_left(self.widths, num_blocks)])

    def all(self) -> list[tuple[int, int]]:
        return [(r, p) for r in self.rows for p in self.widths]


def build_draft_steps(rows: list[DraftRow], k: int, block_table: np.ndarray,
                      shapes: DraftShapes, *, block_size: int, num_blocks: int,
                      full_tables: bool, shape: tuple[int, int] | None = None,
                      sampling: Callable[[int], Any] | None = None,
                      lora_slots: list[int] | None = None) -> Packed:
    """Packed section "draft": (tokens [R] int32, AttentionMetadata with [k, ...] fields),
    then, if given, section "sampling": sampling(R) (draft_sampling: the rows' settings).
    shape: force (R, P) (warm-up: no rows). lora_slots: each row's adapter slot (the
    draft runs the rows' adapters; padding rows the base), or None (no adapters)."""
    n = len(rows)
    pos0 = np.array([r.pos for r in rows], np.int64)
    kr = np.array([r.k for r in rows], np.int64)
    slots = np.array([r.slot for r in rows], np.int64)
    if shape is None:
        # the slots step k_r - 1 reads: its context, or (full tables) its new token too
        reach = int((pos0 + kr - (0 if full_tables else 1)).max()) if n else 0
        shape = shapes.pick(n, -(-reach // block_size))
    R, P = shape
    drop = num_blocks * block_size
    step = np.minimum(np.arange(k)[:, None], kr[None, :] - 1)      # [k, n]
    pos = pos0[None, :] + step
    blk = block_table[slots[None, :], pos // block_size] if n else np.zeros((k, 0), np.int64)
    written = np.arange(k)[:, None] < kr[None, :]
    positions = np.zeros((k, R), np.int32)
    positions[:, :n] = pos
    slot_mapping = np.full((k, R), drop, np.int32)
    slot_mapping[:, :n] = np.where(written, blk * block_size + pos % block_size, drop)
    token_rows = np.full((k, R), R, np.int32)
    token_rows[:, :n] = np.arange(n)
    context_lens = np.zeros((k, R), np.int32)
    context_lens[:, :n] = pos
    seq_lens = np.zeros((k, R), np.int32)
    seq_lens[:, :n] = pos + 1
    qsl = np.zeros(R + 1, np.int32)
    qsl[1:n + 1] = np.arange(1, n + 1)
    qsl[n + 1:] = n
    tables = np.zeros((R, P), np.int32)
    tables[:n] = block_table[slots, :P]
    md = AttentionMetadata(
        positions=positions, slot_mapping=slot_mapping, token_rows=token_rows,
        context_lens=context_lens, seq_lens=seq_lens,
        query_start_loc=np.broadcast_to(qsl, (k, R + 1)).copy(),
        block_tables=np.broadcast_to(tables, (k, R, P)).copy(),
        logits_indices=np.broadcast_to(np.arange(R, dtype=np.int32), (k, R)).copy())
    if lora_slots is not None:
        ls = np.zeros((k, R), np.int32)
        ls[:, :n] = lora_slots
        md = dataclasses.replace(md, lora_slots=ls)
    tokens = np.zeros(R, np.int32)
    tokens[:n] = [r.token for r in rows]
    if sampling is None:
        return pack(draft=(tokens, md))
    return pack(draft=(tokens, md), sampling=sampling(R))


def draft_sampling(states: list[Any], num_rows: int, vocab: int, pad_slot: int,
                   step: int) -> tuple[SamplingMetadata, np.ndarray, np.ndarray]:
    """(SamplingMetadata [R], slots [R], step []) of the drafting rows (runner states,
    in row order; padding rows greedy at the pad slot): the draft samples its first
    proposal at each row's next output position, under the request's own settings;
    step: the runner's step counter (the step's key)."""
    md = build_sampling_metadata([s.sampling_params for s in states],
                                 [s.output_len for s in states],
                                 [s.eos_token_ids for s in states], num_rows, vocab)
    slots = np.full(num_rows, pad_slot, np.int32)
    slots[:len(states)] = [s.slot for s in states]
    return md, slots, np.int32(step % (1 << 31))
