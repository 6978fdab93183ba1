"""Random ragged paged-attention batches for tests and device checks.

A case is what one engine step hands attention: a padded flat token batch of
rows (decode tokens, prefill chunks with or without context), caches that
already hold every row's context plus this step's new K/V, and block tables
wide enough for seq_lens (row pages in random pool order, padding entries 0).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Case:
    q: jax.Array             # [T, N, H]
    k_new: jax.Array         # [T, K, H]
    v_new: jax.Array         # [T, K, H]
    k_cache: jax.Array       # [K, NB, bs, H] context + new tokens written
    v_cache: jax.Array
    cu_q_lens: np.ndarray    # [R+1] int32
    seq_lens: np.ndarray     # [R] int32
    context_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, P] int32
    positions: np.ndarray    # [T] int32
    slot_mapping: np.ndarray  # [T] int32 (NB*bs for padding tokens: dropped)
    token_rows: np.ndarray   # [T] int32 (R for padding tokens)

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_q_lens[-1])

    def kernel_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, jnp.asarray(self.cu_q_lens),
                jnp.asarray(self.seq_lens), jnp.asarray(self.block_tables))

    def metadata_fields(self) -> dict[str, jax.Array]:
        """The fields of the AttentionMetadata the runner would build for this step
        (jaxserve.attention.metadata; the kernels import nothing from jaxserve)."""
        last = np.maximum(self.cu_q_lens[1:] - 1, 0)
        return dict(
            positions=jnp.asarray(self.positions), slot_mapping=jnp.asarray(self.slot_mapping),
            token_rows=jnp.asarray(self.token_rows),
            context_lens=jnp.asarray(self.context_lens), seq_lens=jnp.asarray(self.seq_lens),
            query_start_loc=jnp.asarray(self.cu_q_lens),
            block_tables=jnp.asarray(self.block_tables),
            logits_indices=jnp.asarray(last.astype(np.int32)))


def make_case(rng: np.random.Generator, q_lens: Sequence[int], ctx_lens: Sequence[int], *,
              num_tokens: int, num_rows: int, num_kv_heads: int, group: int, head_dim: int,
              block_size: int, pages: int, num_blocks: int, dtype: Any = jnp.float32) -> Case:
    """Rows with q_lens new tokens after ctx_lens cached ones, padded to
    num_tokens tokens and num_rows rows (extra rows have q_len 0, seq_len 0)."""
    K, N, H, bs = num_kv_heads, num_kv_heads * group, head_dim, block_size
    q_lens = list(q_lens) + [0] * (num_rows - len(q_lens))
    ctx_lens = list(ctx_lens) + [0] * (num_rows - len(ctx_lens))
    seq = np.array([a + b if a else 0 for a, b in zip(q_lens, ctx_lens)], np.int32)
    assert sum(q_lens) <= num_tokens and len(q_lens) == num_rows, (q_lens, num_tokens)
    row_pages = -(-seq // bs)
    assert row_pages.max() <= pages and row_pages.sum() < num_blocks, (row_pages, num_blocks)
    pool = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((num_rows, pages), np.int32)
    start = 0
    for r, n in enumerate(row_pages):
        tables[r, :n] = pool[start:start + n]
        start += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.zeros(num_tokens, np.int32)
    rows = np.full(num_tokens, num_rows, np.int32)
    slots = np.full(num_tokens, num_blocks * bs, np.int32)
    for r in range(num_rows):
        pos = np.arange(ctx_lens[r], ctx_lens[r] + q_lens[r])
        positions[cu[r]:cu[r + 1]] = pos
        rows[cu[r]:cu[r + 1]] = r
        slots[cu[r]:cu[r + 1]] = tables[r, pos // bs] * bs + pos % bs

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    q, k_new, v_new = rand(num_tokens, N, H), rand(num_tokens, K, H), rand(num_tokens, K, H)
    k_cache = _write(rand(K, num_blocks, bs, H), k_new, jnp.asarray(slots))
    v_cache = _write(rand(K, num_blocks, bs, H), v_new, jnp.asarray(slots))
    return Case(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                cu_q_lens=cu, seq_lens=seq,
                context_lens=np.where(seq > 0, np.array(ctx_lens, np.int32), 0).astype(np.int32),
                block_tables=tables, positions=positions, slot_mapping=slots, token_rows=rows)


def _write(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """new [T, K, H] scattered into cache [K, B, bs, H] at flat slots [T] (out-of-range
    slots, padding tokens, dropped): what the decoder's write_kv does to a float cache."""
    K, B, bs, H = cache.shape
    flat = cache.reshape(K, B * bs, H).at[:, slots].set(
        new.swapaxes(0, 1).astype(cache.dtype), mode="drop")
    return flat.reshape(K, B, bs, H)
