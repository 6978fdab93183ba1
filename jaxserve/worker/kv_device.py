"""Sizing and allocation of the device KV arrays (the runner owns them after this).

Layout per layer: k and v are [K, num_blocks, block_size, H] (kv heads major, so a
gather of a row's slots gives [K, T, S, H] with batch axes leading, which XLA turns
into plain batched dots without transposes). The page-major TPU kernel's layout
(--tpu-attention-kernel pm) is attention/kv_layout.py's; a block costs the same bytes.
"""
from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.attention import kv_quant
from jaxserve.model.config import ModelConfig

log = logging.getLogger("jaxserve")

CPU_DEFAULT_KV_BYTES = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: Any,
                    kv_heads: int | None = None, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block over all layers; kv_heads: the heads one device stores
    (default: all of the model's KV heads); kv_cache_dtype int8 / fp8: one byte per
    value plus a float32 scale per (token, head) (attention/kv_quant.py)."""
    heads = cfg.num_kv_heads if kv_heads is None else kv_heads
    per_slot_head = kv_quant.bytes_per_slot_head(kv_cache_dtype, cfg.head_dim, dtype)
    return 2 * cfg.num_layers * heads * block_size * per_slot_head


def choose_num_blocks(cfg: ModelConfig, block_size: int, dtype: Any, *, num_kv_blocks: int | None,
                      kv_cache_memory: int | None, memory_fraction: float,
                      max_model_len: int, kv_heads_per_device: int | None = None,
                      kv_cache_dtype: str = "auto") -> int:
    """Blocks from an explicit count, a byte budget, or free device memory. Budgets are
    per device: under a sharding plan a device stores kv_heads_per_device heads."""
    per_block = bytes_per_block(cfg, block_size, dtype, kv_heads_per_device, kv_cache_dtype)
    if num_kv_blocks is not None:
        n = num_kv_blocks
        how = "--num-kv-blocks"
    else:
        budget = kv_cache_memory
        how = "--kv-cache-memory"
        if budget is None:
            budget = _free_device_bytes(memory_fraction)
            how = f"{memory_fraction:.0%} of free device memory" if budget else "CPU default"
            budget = budget or CPU_DEFAULT_KV_BYTES
        n = max(2, budget // per_block)
    needed = -(-max_model_len // block_size)
    if n < needed:
        raise ValueError(f"KV cache of {n} blocks x {block_size} tokens cannot hold one request of "
                         f"max_model_len={max_model_len} ({needed} blocks); raise the KV budget "
                         f"or lower --max-model-len")
    store = jnp.dtype(dtype).name if kv_cache_dtype == "auto" else f"{kv_cache_dtype} + f32 scales"
    log.info("KV cache: %s, %d blocks x %d tokens, %d bytes/block (%.1f MiB, %s)", store, n,
             block_size, per_block, n * per_block / 2**20, how)
    return int(n)


def _free_device_bytes(fraction: float) -> int | None:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    try:
        stats = dev.memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return int(free * fraction) if free > 0 else None
    except Exception:  # memory_stats is unavailable on some backends
        return None
