"""The device KV cache's two layouts, and which attention kernel reads which.

    head_major  each layer is the pair (k, v), each [K, num_blocks, block_size, H]
                (kv heads outermost; every backend but the page-major TPU kernel)
    page_major  each layer is the pair (kv, None), kv [num_blocks, 2K, block_size, H]:
                page p holds head h's keys at [p, 2h] and its values at [p, 2h + 1]
                (kernels_pallas/ragged_paged_attention/kernel_tpu_pm.py, selected with
                --tpu-attention-kernel pm)

A page-major layer keeps the pair's shape, its second slot empty, so the decoder's
per-layer (k, v) unpacking, the step's jit and shard_map trees and the layerwise step's
split into k and v tuples are the same code for both layouts. int8 / fp8 caches are
attention/kv_quant.QuantizedKV leaves in either layout (page-major scales
[num_blocks, 2K, block_size]).

Code that indexes blocks (kv_transfer/, the drafter's own pool) reads head-major caches
only; EngineArgs refuses those features with the page-major kernel (docs/kernels.md).
"""
from __future__ import annotations

from typing import Any

HEAD_MAJOR = "head_major"
PAGE_MAJOR = "page_major"
LAYOUTS = (HEAD_MAJOR, PAGE_MAJOR)

# --tpu-attention-kernel choices: v3 (kernel_tpu_v3, in-kernel KV loops), tiled
# (kernel_tpu, BlockSpec-pipelined pages), pm (kernel_tpu_pm, page-major cache)
TPU_KERNELS = ("v3", "tiled", "pm")


def layout_for(backend: str, platform: str, tpu_kernel: str) -> str:
    """The layout the chosen attention reads: page-major only for the Pallas backend
    with the pm kernel on TPU, or on CPU, where the TPU interpreter runs it."""
    if tpu_kernel not in TPU_KERNELS:
        raise ValueError(f"tpu_attention_kernel {tpu_kernel!r}: choose one of {TPU_KERNELS}")
    if backend == "pallas" and tpu_kernel == "pm" and platform in ("tpu", "cpu"):
        return PAGE_MAJOR
    return HEAD_MAJOR


def cache_shape(layout: str, kv_heads: int, num_blocks: int, block_size: int,
                head_dim: int) -> tuple[int, int, int, int]:
    """One cache array's shape: a head-major k (or v), or a page-major kv."""
    if layout == PAGE_MAJOR:
        return (num_blocks, 2 * kv_heads, block_size, head_dim)
    return (kv_heads, num_blocks, block_size, head_dim)


def layer(layout: str, make: Any) -> tuple[Any, Any]:
    """One layer's pair from make() (a zeroed array or QuantizedKV): (k, v) or (kv, None)."""
    return (make(), None) if layout == PAGE_MAJOR else (make(), make())


def head_axis(layout: str) -> int:
    """The axis of a cache array that holds the (K or 2K) head rows."""
    return 1 if layout == PAGE_MAJOR else 0
