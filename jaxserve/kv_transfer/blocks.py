"""Moving whole KV blocks out of and into the runner's device KV cache.

The cache is a list over layers of (k, v), each [K, num_blocks, S, H] (worker/kv_device.py).
A transfer moves a request's blocks as one host array

    [L, 2, K, n, S, H]      L layers, 2 = (k, v), K kv heads, n blocks, S block size, H head dim

in chunks of C = chunk_blocks blocks, each through one jitted gather (read out) or one
jitted scatter (written in, the cache donated). Both have one fixed shape, compiled at
start-up; a short chunk is padded: gather ids with block 0 (read and dropped), scatter
ids with num_blocks, an out-of-range index that `mode="drop"` discards, so padding never
writes a real block. The scatter keeps the cache's own shardings (out_shardings), so the
step sees the same input shardings as before and does not recompile.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

KVCache = list  # list over layers of (k, v) device arrays [K, NB, S, H]


class BlockMover:
    def __init__(self, kv: KVCache, chunk_blocks: int) -> None:
        k0 = kv[0][0]
        self.num_layers = len(kv)
        self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim = k0.shape
        self.dtype = np.dtype(k0.dtype)
        self.chunk = chunk_blocks
        self.num_compiles = 0
        # Shardings pinned on every argument: warm-up sees the initial (uncommitted)
        # cache, later calls a step's (committed) output; without in_shardings that
        # difference alone made XLA compile both functions again on first real use.
        shardings = jax.tree.map(lambda x: x.sharding, kv)
        small = _replicated(k0.sharding)
        self._gather = jax.jit(self._counted(_gather), in_shardings=(shardings, small))
        self._scatter = jax.jit(self._counted(_scatter), donate_argnums=0,
                                in_shardings=(shardings, small, small),
                                out_shardings=shardings)

    def _counted(self, fn: Callable) -> Callable:
        def traced(*args: Any) -> Any:
            self.num_compiles += 1        # runs only while tracing
            return fn(*args)
        return traced

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block across the model: [L, 2, K, S, H] minus nothing (n=1)."""
        return (self.num_layers, 2, self.num_kv_heads, 1, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def host_shape(self, n: int) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, n, self.block_size, self.head_dim)

    def warmup(self, kv: KVCache) -> KVCache:
        """Compile both functions (the scatter writes nothing: every id is padding)."""
        jax.block_until_ready(self._gather(kv, jnp.zeros(self.chunk, jnp.int32)))
        data = jnp.zeros(self.host_shape(self.chunk), self.dtype)
        ids = jnp.full(self.chunk, self.num_blocks, jnp.int32)
        return self._scatter(kv, ids, data)

    def gather(self, kv: KVCache, block_ids: list[int]) -> list[jax.Array]:
        """Start reading the blocks out (returns at once): one device array per chunk,
        [L, 2, K, C, S, H]; a later device_get waits for them."""
        out = []
        for i in range(0, len(block_ids), self.chunk):
            ids = np.zeros(self.chunk, np.int32)
            part = block_ids[i:i + self.chunk]
            ids[:len(part)] = part
            out.append(self._gather(kv, jnp.asarray(ids)))
        return out

    def to_host(self, chunks: list[jax.Array], n: int) -> np.ndarray:
        """The first n blocks of gathered chunks as one host array [L, 2, K, n, S, H]."""
        host = [np.asarray(jax.device_get(c)) for c in chunks]
        return np.concatenate(host, axis=3)[:, :, :, :n] if host else \
            np.zeros(self.host_shape(0), self.dtype)

    def scatter(self, kv: KVCache, block_ids: list[int], data: np.ndarray) -> KVCache:
        """Write host data [L, 2, K, n, S, H] into the blocks (n = len(block_ids));
        returns the new cache (the old one is donated)."""
        assert data.shape == self.host_shape(len(block_ids)), (data.shape, len(block_ids))
        for i in range(0, len(block_ids), self.chunk):
            part = block_ids[i:i + self.chunk]
            ids = np.full(self.chunk, self.num_blocks, np.int32)
            ids[:len(part)] = part
            chunk = np.zeros(self.host_shape(self.chunk), self.dtype)
            chunk[:, :, :, :len(part)] = data[:, :, :, i:i + len(part)]
            kv = self._scatter(kv, jnp.asarray(ids), jnp.asarray(chunk))
        return kv


def _replicated(sharding: Any) -> Any:
    """Where the block ids and block data live: beside the cache, whole."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def _gather(kv: KVCache, ids: jax.Array) -> jax.Array:
    # [L, 2, K, C, S, H]
    return jnp.stack([jnp.stack([k[:, ids], v[:, ids]]) for k, v in kv])


def _scatter(kv: KVCache, ids: jax.Array, data: jax.Array) -> KVCache:
    return [(k.at[:, ids].set(data[i, 0], mode="drop"),
             v.at[:, ids].set(data[i, 1], mode="drop")) for i, (k, v) in enumerate(kv)]
