"""Host-side construction of one step's flat ragged batch, padded to a bucket.

    row r:      |--- context (in cache) ---|--- new tokens this step ---|
    tokens:     ...[qsl[r] : qsl[r+1]] = token_ids[ctx : ctx + n]
    positions:  ctx ... ctx+n-1
    slots:      block_ids[pos // bs] * bs + pos % bs

Padding tokens write to an out-of-range slot (dropped) and belong to a row index
past the real rows; padding rows have seq_len 0 and point at the pad slot.

A token the host does not know yet (sampled by a step still in flight: asynchronous
scheduling) is fed on the device: feed[i] is the request's slot, whose last sampled
token the step reads instead of tokens[i] (-1: the host token).

Logit rows (what the head and sampler see, [R] of them): one per row, at its last
token; a row with k proposed tokens (speculative decoding) has k + 1, at its last k + 1
tokens (its last known token and the proposals), so the sampler verifies them all in
this step. rows + proposals <= R: the scheduler keeps proposals within max_num_seqs
logit rows, and a bucket of T <= max_num_seqs tokens has R = T rows.

A multi-step decode step (so.num_steps = k > 1: every row a decode row) is built as its
first decode step, one token per row; the device advances positions, slots and lengths
for the k - 1 steps after it (step_programs.advance_decode), so the block tables are made
wide enough for the last one's context.

Everything here is numpy: the runner packs a step's inputs into one buffer and sends
it in one transfer (packing.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.attention.tiles import build_query_tiles
from jaxserve.worker.buckets import BucketSet
from jaxserve.core.sched.output import SchedulerOutput, StepKind


@dataclass(slots=True)
class StepBatch:
    tokens: np.ndarray                # [T] int32
    md: AttentionMetadata             # numpy arrays
    row_req_ids: list[str]            # real rows, in row order
    row_samples: list[bool]           # does row r sample a token this step?
    row_slots: np.ndarray             # [R] persistent slot of each row (pad slot for padding)
    num_tokens: int                   # real tokens (before padding)
    feed: np.ndarray | None = None    # [T] int32 slot whose last sampled token goes here, or -1
    # logit rows (see the module docstring); None: one per row, in row order
    logit_start: np.ndarray | None = None   # [rows + 1] int32 row r's are [s[r], s[r+1])
    logit_slots: np.ndarray | None = None   # [R] int32 persistent slot of each logit row
    drafts: list[list[int]] | None = None   # proposed tokens of each real row

    @classmethod
    def dummy(cls, t: int, r: int, p: int, num_blocks: int, block_size: int,
              pad_slot: int, full_tables: bool = False, lora: bool = False) -> "StepBatch":
        tiles = {}
        if t > r and p > 0 and not full_tables:
            qsl = np.zeros(r + 1, np.int32)
            tr, tt, ts = build_query_tiles(qsl, 0, t, r)
            tiles = dict(tile_rows=_i32(tr), tile_tokens=_i32(tt), token_tile_slot=_i32(ts))
        md = AttentionMetadata(
            positions=np.zeros(t, np.int32),
            slot_mapping=np.full(t, num_blocks * block_size, np.int32),
            token_rows=np.full(t, r, np.int32),
            context_lens=np.zeros(r, np.int32),
            seq_lens=np.zeros(r, np.int32),
            query_start_loc=np.zeros(r + 1, np.int32),
            block_tables=np.zeros((r, p), np.int32),
            logits_indices=np.zeros(r, np.int32), **tiles,
            lora_slots=np.zeros(t, np.int32) if lora else None,
        )
        return cls(np.zeros(t, np.int32), md, [], [], np.full(r, pad_slot, np.int32), 0,
                   np.full(t, -1, np.int32))


def build_step_batch(so: SchedulerOutput, states: Mapping[str, Any], block_table: np.ndarray,
                     buckets: BucketSet, *, block_size: int, num_blocks: int, pad_slot: int,
                     full_tables: bool, lora: bool = False) -> StepBatch:
    """lora: the engine serves adapters; each token carries its row's state's lora_slot
    (0 for padding: the base model)."""
    req_ids = [n.req_id for n in so.scheduled_new_reqs] + \
              [c.req_id for c in so.scheduled_cached_reqs]
    k = so.num_steps                 # multi-step: one token per row, up to k times
    multi = so.kind is StepKind.MULTI_STEP_DECODE
    counts = np.array([1 if multi else so.num_scheduled_tokens[r] for r in req_ids], np.int32)
    num_rows = len(req_ids)
    total = int(counts.sum())
    st_list = [states[r] for r in req_ids]
    ctx = np.array([s.num_computed_tokens for s in st_list], np.int32)
    seq = ctx + counts
    widest = (seq.max() if full_tables else ctx.max()) + k - 1 if num_rows else 0
    need_blocks = int(-(-widest // block_size))
    T, P = buckets.pick(total, need_blocks)
    R = buckets.rows_for(T)
    assert num_rows <= R, (num_rows, R)

    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    rows = np.full(T, R, np.int32)
    qsl = np.zeros(R + 1, np.int32)
    qsl[1:num_rows + 1] = np.cumsum(counts)
    qsl[num_rows + 1:] = total
    row_slots = np.full(R, pad_slot, np.int32)
    feed = np.full(T, -1, np.int32)
    lora_slots = np.zeros(T, np.int32) if lora else None
    row_samples = []
    spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    drafts = [spec.get(rid, []) for rid in req_ids]
    for r, s in enumerate(st_list):
        a, b = qsl[r], qsl[r + 1] - len(drafts[r])       # proposals: tokens[b:qsl[r+1]]
        known = len(s.token_ids)
        host = a + max(0, min(int(seq[r]) - len(drafts[r]), known) - int(ctx[r]))
        tokens[a:host] = s.token_ids[ctx[r]:host - a + ctx[r]]    # tokens[a:host] known
        assert b - host <= 1, "only the last sampled token is on the device"
        feed[host:b] = s.slot            # the pending token: on the device
        tokens[b:qsl[r + 1]] = drafts[r]
        positions[a:qsl[r + 1]] = np.arange(ctx[r], seq[r], dtype=np.int32)
        rows[a:qsl[r + 1]] = r
        if lora_slots is not None:
            lora_slots[a:qsl[r + 1]] = s.lora_slot
        row_slots[r] = s.slot
        row_samples.append(int(seq[r]) - len(drafts[r]) == known + s.num_pending)
    slot_rows = row_slots[rows[:total]]
    blk = block_table[slot_rows, positions[:total] // block_size]
    slot_mapping = np.full(T, num_blocks * block_size, np.int32)
    slot_mapping[:total] = blk * block_size + positions[:total] % block_size

    context_lens = np.zeros(R, np.int32)
    context_lens[:num_rows] = ctx
    seq_lens = np.zeros(R, np.int32)
    seq_lens[:num_rows] = seq
    logits_idx, logit_start, logit_slots = _logit_rows(qsl, drafts, row_samples, row_slots,
                                                       pad_slot, R)
    tiles = {}
    if T > R and P > 0 and not full_tables:   # prefill-sized bucket: gather context per tile
        tr, tt, ts = build_query_tiles(qsl, num_rows, T, R)
        tiles = dict(tile_rows=_i32(tr), tile_tokens=_i32(tt), token_tile_slot=_i32(ts))
    md = AttentionMetadata(
        positions=positions, slot_mapping=slot_mapping, token_rows=rows,
        context_lens=context_lens, seq_lens=seq_lens, query_start_loc=qsl,
        block_tables=_i32(block_table[row_slots, :P]), logits_indices=logits_idx,
        lora_slots=lora_slots, **tiles)
    return StepBatch(tokens, md, req_ids, row_samples, row_slots, total, feed,
                     logit_start, logit_slots, drafts)


def _logit_rows(qsl: np.ndarray, drafts: list[list[int]], row_samples: list[bool],
                row_slots: np.ndarray, pad_slot: int, R: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits_indices [R], logit_start [rows + 1], logit_slots [R]): row r's logit
    rows are its last 1 + len(drafts[r]) tokens (1 unless it samples and speculates)."""
    num_rows = len(drafts)
    per_row = np.array([1 + (len(d) if smp else 0) for d, smp in zip(drafts, row_samples)],
                       np.int32)
    start = np.zeros(num_rows + 1, np.int32)
    start[1:] = np.cumsum(per_row)
    G = int(start[-1])
    assert G <= R, f"{G} logit rows in a bucket of {R} rows (proposals not capped?)"
    logits_idx = np.zeros(R, np.int32)
    logit_slots = np.full(R, pad_slot, np.int32)
    if G == num_rows:                # no proposals: one logit row per row, at its end
        logits_idx[:num_rows] = np.maximum(qsl[1:num_rows + 1] - 1, 0)
        logit_slots[:num_rows] = row_slots[:num_rows]
        return logits_idx, start, logit_slots
    owner = np.repeat(np.arange(num_rows), per_row)
    offset = np.arange(G) - start[owner]                     # j within the row
    logits_idx[:G] = qsl[owner + 1] - per_row[owner] + offset
    logit_slots[:G] = row_slots[owner]
    return logits_idx, start, logit_slots


def _i32(a: Any) -> np.ndarray:
    return np.asarray(a, np.int32)
