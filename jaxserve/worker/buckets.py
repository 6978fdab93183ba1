"""Bucket shapes: every step is padded to one of a small, fixed set of shapes.

A step's shape is (T tokens, P block-table width). Rows R = min(T, max_num_seqs) follow
from T, so they add no compile dimension. All (T, P) pairs are compiled at warm-up.

Default token buckets on CPU: 1, then every power of two from 4 to the step budget. A
decode step of B requests runs in the smallest bucket >= B, and the step's cost grows
with T (the head alone computes R rows of vocabulary logits), so padding one decode to 16
tokens made a batch-1 step cost several times more (docs/benchmarks.md, "Measurements behind code choices"). Up to 8 tokens a
step streams the weights once whatever its rows (the decoder-stack kernel), so two
decodes in the 4-token bucket cost what they cost in a 2-token one (docs/benchmarks.md,
"Buckets and compile time") and the 2-token bucket's fused program (large, with its inlined
sampler, and a share of every warm start) is not built. Each other bucket costs seconds
of compile at a cold start (one layer, embedding and head per bucket) and far less at a
warm one. On
GPU/TPU the smallest bucket is 8: a step with fewer rows costs the same there (8
sublanes / one warp tile) and each fused bucket compiles all layers.

Where the sampler is a program of its own (layerwise buckets; every bucket on GPU/TPU),
it is keyed by its row count only, and rows above 8 are padded up to a sampler row
bucket (64, 512, ..., the last = the largest R): the default CPU engine's layerwise
buckets (16 to 512 tokens, rows 16, 32, 64) share one sampler program instead of three
(a sampler is ~250 KB of code, the largest part of a bucket's compile and load). Steps
of up to 8 rows keep their own: the CPU's fused decode buckets inline the sampler (as a
program of its own it cost a batch-1 decode step 5-15%), and sampling padded rows costs
a small step most.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

CPU_MIN_TOKEN_BUCKET = 1
ACCEL_MIN_TOKEN_BUCKET = 8
SAMPLER_ROW_BUCKET = 8      # sampler rows: exact up to 8, then 8**2, 8**3, ... (capped)


def default_min_token_bucket(platform: str | None = None) -> int:
    """The smallest default token bucket for `platform` (jax's default backend if None)."""
    if platform is None:
        import jax
        platform = jax.default_backend()
    return CPU_MIN_TOKEN_BUCKET if platform == "cpu" else ACCEL_MIN_TOKEN_BUCKET


def power_of_two_buckets(smallest: int, budget: int) -> list[int]:
    """smallest, 2*smallest, ... below `budget`, then `budget` itself."""
    tb, b = [], max(1, min(smallest, budget))
    while b < budget:
        tb.append(b)
        b *= 2
    return tb + [budget]


@dataclass(frozen=True, slots=True)
class BucketSet:
    token_buckets: tuple[int, ...]      # ascending; last = max_num_batched_tokens
    block_buckets: tuple[int, ...]      # ascending; 0 first (no context), last = max blocks/seq
    max_num_seqs: int
    # fit_chunk cuts a step only down to a bucket of at least this many tokens: a cut
    # delays the prompt's first token by a step, worth it only when it saves >= this
    # many padded tokens (each one costs a full token's compute).
    min_cut_bucket: int = 32

    @classmethod
    def build(cls, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
              block_size: int, token_buckets: list[int] | None = None,
              min_token_bucket: int | None = None,
              single_table_width: bool = False) -> "BucketSet":
        if token_buckets:
            tb = sorted({min(b, max_num_batched_tokens) for b in token_buckets})
            if tb[-1] != max_num_batched_tokens:
                tb.append(max_num_batched_tokens)
        else:
            smallest = min_token_bucket or default_min_token_bucket()
            tb = power_of_two_buckets(smallest, max_num_batched_tokens)
            if smallest == 1 and len(tb) > 2 and tb[1] == 2:    # 1, 4, 8, ... (above)
                tb.remove(2)
        max_blocks = -(-max_model_len // block_size)
        if single_table_width:      # the backend's cost does not depend on the width
            return cls(tuple(sorted(set(tb))), (max_blocks,), max_num_seqs)
        # Block-table widths: 0, then doubling from 8 blocks, capped at the longest row.
        bb, b = [0], min(8, max_blocks)
        while b < max_blocks:
            bb.append(b)
            b *= 2
        bb.append(max_blocks)
        return cls(tuple(sorted(set(tb))), tuple(sorted(set(bb))), max_num_seqs)

    def rows_for(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    def sampler_rows(self, rows: int) -> int:
        """The sampler's row count for a step of `rows` rows: `rows` up to 8, else the
        smallest of 64, 512, ... that holds them, capped at the largest step's rows."""
        if rows <= SAMPLER_ROW_BUCKET:
            return rows
        b = SAMPLER_ROW_BUCKET
        while b < rows:
            b *= SAMPLER_ROW_BUCKET
        return min(b, self.rows_for(self.token_buckets[-1]))

    def pick(self, num_tokens: int, num_blocks: int) -> tuple[int, int]:
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        p = self.block_buckets[bisect.bisect_left(self.block_buckets, num_blocks)]
        return t, p

    def fit_chunk(self, used: int, wanted: int) -> int:
        """Padding-aware prefill chunk: how many of `wanted` prompt tokens to add to a step
        that already holds `used` tokens.

        When `used + wanted` lands just above a bucket, most of the next bucket would be
        padding: the chunk is cut to end exactly on the lower bucket, and the few tokens
        left over ride along with the next step's decodes. Cut only when the padding
        saved exceeds the tokens deferred, never below `min_cut_bucket` tokens and never
        to an empty chunk."""
        total = used + wanted
        i = bisect.bisect_left(self.token_buckets, total)
        if i == 0 or i == len(self.token_buckets) or self.token_buckets[i] == total:
            return wanted
        lo, hi = self.token_buckets[i - 1], self.token_buckets[i]
        if lo <= used or lo < self.min_cut_bucket or hi - total <= total - lo:
            return wanted
        return lo - used

    def all_shapes(self) -> list[tuple[int, int]]:
        return [(t, p) for t in self.token_buckets for p in self.block_buckets]
