"""Bucket shapes: every step is padded to one of a small, fixed set of shapes.

A step's shape is (T tokens, P block-table width). Rows R = min(T, max_num_seqs) follow
from T, so they add no compile dimension. All (T, P) pairs are compiled at warm-up.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BucketSet:
    token_buckets: tuple[int, ...]      # ascending; last = max_num_batched_tokens
    block_buckets: tuple[int, ...]      # ascending; 0 first (no context), last = max blocks/seq
    max_num_seqs: int

    @classmethod
    def build(cls, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
              block_size: int, token_buckets: list[int] | None = None,
              min_token_bucket: int = 16, single_table_width: bool = False) -> "BucketSet":
        if token_buckets:
            tb = sorted({min(b, max_num_batched_tokens) for b in token_buckets})
        else:
            tb, b = [], min(min_token_bucket, max_num_batched_tokens)
            while b < max_num_batched_tokens:
                tb.append(b)
                b *= 2
        if not tb or tb[-1] != max_num_batched_tokens:
            tb.append(max_num_batched_tokens)
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

    def pick(self, num_tokens: int, num_blocks: int) -> tuple[int, int]:
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        p = self.block_buckets[bisect.bisect_left(self.block_buckets, num_blocks)]
        return t, p

    def all_shapes(self) -> list[tuple[int, int]]:
        return [(t, p) for t in self.token_buckets for p in self.block_buckets]
