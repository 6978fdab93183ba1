"""Whole KV blocks between the device cache and host bytes, for the offload tiers.

The device cache is any pytree whose leaves are [K, num_blocks, ...]: per layer a (k, v)
pair of plain arrays, or of attention/kv_quant.QuantizedKV (int8 / fp8 values and
float32 scales). One block, across every leaf, is one row of raw bytes:

    row = leaf0[:, b] bytes | leaf1[:, b] bytes | ...        (bytes_per_block long)

so the host and disk tiers store, checksum and compare plain byte rows whatever the
cache's dtype. Both directions run in chunks of C blocks through one jitted program
each, of one fixed shape compiled at start-up:

    gather(kv, ids[C])           -> uint8 [C, bytes_per_block]
    scatter(kv, ids[C], rows)    -> kv   (the cache donated; ids == num_blocks drop)

A short chunk is padded: gather ids with block 0 (read and dropped), scatter ids with
num_blocks, an out-of-range index that `mode="drop"` discards, so padding never writes
a real block. A committed cache (a sharding plan, or one placed on a device) has its
shardings pinned on every argument and the scatter keeps the cache's own
(out_shardings); an uncommitted one stays uncommitted (jit keys its programs on that
too). Either way the cache the step sees after a scatter is the kind it was compiled
for, and nothing compiles again after warm-up.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


class BlockCopier:
    def __init__(self, kv: Any, chunk_blocks: int) -> None:
        leaves, self.treedef = jax.tree.flatten(kv)
        self.num_blocks = int(leaves[0].shape[1])
        # per leaf: one block's shape (the block axis removed) and dtype
        self.layout = [((int(x.shape[0]), *map(int, x.shape[2:])), np.dtype(x.dtype))
                       for x in leaves]
        self.sizes = [int(np.prod(s)) * d.itemsize for s, d in self.layout]
        self.bytes_per_block = sum(self.sizes)
        self.chunk = chunk_blocks
        self.num_compiles = 0
        gather, scatter = self._counted(self._gather_fn), self._counted(self._scatter_fn)
        if getattr(leaves[0], "committed", True):
            shardings = jax.tree.map(lambda x: x.sharding, kv)
            small = _replicated(leaves[0].sharding)
            self._gather = jax.jit(gather, in_shardings=(shardings, small))
            self._scatter = jax.jit(scatter, donate_argnums=0,
                                    in_shardings=(shardings, small, small),
                                    out_shardings=shardings)
        else:   # an uncommitted cache stays uncommitted, as the step programs expect
            self._gather = jax.jit(gather)
            self._scatter = jax.jit(scatter, donate_argnums=0)

    def describe(self) -> str:
        """The layout as text (it goes into the disk tier's compatibility digest)."""
        return ";".join(f"{s}:{d.str}" for s, d in self.layout)

    def _counted(self, fn: Callable) -> Callable:
        def traced(*args: Any) -> Any:
            self.num_compiles += 1        # runs only while tracing
            return fn(*args)
        return traced

    # ---- the two programs (traced) -------------------------------------------------
    def _gather_fn(self, kv: Any, ids: jax.Array) -> jax.Array:
        rows = []
        for x in jax.tree.leaves(kv):
            part = jnp.moveaxis(x[:, ids], 1, 0)             # [C, K, ...]
            rows.append(_to_bytes(part).reshape(self.chunk, -1))
        return jnp.concatenate(rows, axis=1)

    def _scatter_fn(self, kv: Any, ids: jax.Array, rows: jax.Array) -> Any:
        out, start = [], 0
        for x, (shape, dtype), size in zip(jax.tree.leaves(kv), self.layout, self.sizes):
            raw = rows[:, start:start + size]
            start += size
            part = _from_bytes(raw, (self.chunk, *shape), dtype)   # [C, K, ...]
            out.append(x.at[:, ids].set(jnp.moveaxis(part, 0, 1), mode="drop"))
        return jax.tree.unflatten(self.treedef, out)

    # ---- host side -----------------------------------------------------------------
    def warmup(self, kv: Any) -> Any:
        """Compile both programs and the host-to-device copies of their arguments (the
        scatter writes nothing: every id is padding)."""
        jax.block_until_ready(self.gather(kv, [0]))
        ids = np.full(self.chunk, self.num_blocks, np.int32)
        rows = np.zeros((self.chunk, self.bytes_per_block), np.uint8)
        return self._scatter(kv, jnp.asarray(ids), jnp.asarray(rows))

    def gather(self, kv: Any, block_ids: list[int]) -> list[jax.Array]:
        """Start reading the blocks out (returns at once): one uint8 device array
        [C, bytes_per_block] per chunk, in order; `rows` waits for them."""
        out = []
        for i in range(0, len(block_ids), self.chunk):
            ids = np.zeros(self.chunk, np.int32)
            part = block_ids[i:i + self.chunk]
            ids[:len(part)] = part
            out.append(self._gather(kv, jnp.asarray(ids)))
        return out

    @staticmethod
    def rows(chunks: list[jax.Array], n: int) -> list[np.ndarray]:
        """The first n gathered blocks, each its own host byte row (copies, so no row
        keeps a whole chunk alive)."""
        out: list[np.ndarray] = []
        for c in chunks:
            host = np.asarray(jax.device_get(c))
            out.extend(np.array(r) for r in host[:n - len(out)])
        return out

    def scatter(self, kv: Any, block_ids: list[int], rows: list[np.ndarray]) -> Any:
        """Write one byte row per block into the blocks; returns the new cache (the old
        one is donated)."""
        assert len(rows) == len(block_ids)
        for i in range(0, len(block_ids), self.chunk):
            part = block_ids[i:i + self.chunk]
            ids = np.full(self.chunk, self.num_blocks, np.int32)
            ids[:len(part)] = part
            data = np.zeros((self.chunk, self.bytes_per_block), np.uint8)
            for j, row in enumerate(rows[i:i + len(part)]):
                data[j] = row
            kv = self._scatter(kv, jnp.asarray(ids), jnp.asarray(data))
        return kv


def _to_bytes(x: jax.Array) -> jax.Array:
    """Same shape for 1-byte dtypes, one trailing axis of itemsize otherwise."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def _from_bytes(raw: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(raw.reshape(shape), dtype)
    return jax.lax.bitcast_convert_type(raw.reshape(*shape, dtype.itemsize), dtype)


def _replicated(sharding: Any) -> Any:
    """Where the block ids and rows live: beside the cache, whole."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding
