"""Block sizes of the page-major TPU kernel (kernel_tpu_pm.py) as tuning data.

TUNING maps (chip generation, head dim, KV storage dtype) to, per bucket kind,
(query rows per tile, KV bytes per chunk). A chunk is a whole number of pages, so the
byte budget becomes pages_per_chunk = budget // page bytes (page bytes = 2 * K * bs *
H * itemsize: every local head's K and V). Three chunks live in VMEM at once.

Why these numbers (first guesses, unmeasured on hardware; jaxserve/tools/kernel_model.py
prints what they imply):
* decode is HBM-bound: by Little's law the bytes in flight must cover bandwidth x
  latency. Two chunks are in flight while one is computed, so v5e (819 GB/s) gets
  1 MiB chunks (2 MiB in flight) and v6e (1640 GB/s) 2 MiB.
* prefill / mixed tiles are 128 (v5e MXU) or 256 (v6e MXU) rows tall and compute-bound;
  their chunks stay at 512 KiB so the [rows, chunk] float32 scores stay small.
* A chunk never exceeds a row's block table (max_pages) nor SCORE_BYTES of scores.
"""
from __future__ import annotations

from typing import Any

import numpy as np

KIB, MIB = 2 ** 10, 2 ** 20
# [block_m, chunk] float32 scores (and probabilities) per head kept under this
SCORE_BYTES = 2 * MIB
# K+V bytes of all SLOTS chunks kept under this (v5e's default scoped VMEM is 16 MiB)
VMEM_KV_BYTES = 9 * MIB

_V5E = {"decode": (16, 1 * MIB), "prefill": (128, 512 * KIB), "mixed": (128, 512 * KIB)}
_V6E = {"decode": (16, 2 * MIB), "prefill": (256, 512 * KIB), "mixed": (128, 1 * MIB)}
TUNING: dict[tuple[str, int, str], dict[str, tuple[int, int]]] = {
    ("v5e", 128, "bfloat16"): _V5E,
    ("v5e", 128, "int8"): _V5E,
    ("v5e", 128, "float8_e4m3fn"): _V5E,
    ("v5e", 256, "bfloat16"): {**_V5E, "prefill": (128, 1 * MIB), "mixed": (128, 1 * MIB)},
    ("v5e", 64, "bfloat16"): _V5E,
    ("v6e", 128, "bfloat16"): _V6E,
    ("v6e", 128, "int8"): _V6E,
    ("v6e", 128, "float8_e4m3fn"): _V6E,
    ("v6e", 256, "bfloat16"): {**_V6E, "prefill": (256, 1 * MIB)},
    ("v6e", 64, "bfloat16"): _V6E,
}
# any (chip, head dim, dtype) not listed: the chip's bf16 / 128 row, else v5e's
DEFAULT = _V5E


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}


def dtype_name(dtype: Any) -> str:
    """A dtype or its name ('bfloat16', ...): names keep this table free of jax."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def lookup(chip: str, head_dim: int, dtype: Any, kind: str) -> tuple[int, int]:
    """(block_m, chunk bytes) for one configuration."""
    name = dtype_name(dtype)
    entry = TUNING.get((chip, head_dim, name)) or TUNING.get((chip, 128, "bfloat16")) or DEFAULT
    return entry[kind]


def page_bytes(kv_heads: int, page_size: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one page: K and V of every local kv head."""
    return 2 * kv_heads * page_size * head_dim * itemsize


def block_sizes(kind: str, chip: str, *, group: int, kv_heads: int, head_dim: int,
                page_size: int, dtype: Any, max_pages: int) -> tuple[int, int]:
    """(block_m, pages_per_chunk) for a bucket kind on a chip generation."""
    block_m, budget = lookup(chip, head_dim, dtype, kind)
    if kind == "decode":          # one token's GQA group per tile, sublane-aligned
        block_m = max(block_m, -(-group // 16) * 16)
    pb = page_bytes(kv_heads, page_size, head_dim, ITEMSIZE[dtype_name(dtype)])
    pages = max(1, budget // pb)
    pages = min(pages, max(1, VMEM_KV_BYTES // (3 * pb)))
    pages = min(pages, max(1, SCORE_BYTES // (4 * block_m * page_size)))
    return block_m, max(1, min(pages, max_pages))
