"""Block sizes of the quantized matmul, per backend. Starting points chosen from the
chips' limits (docs/kernels.md, "Weight-only quantized matmul"), not from a
measurement: no TPU or GPU has run this kernel yet. A block larger than the matrix is
cut down to it (kernel.py: blocks_for)."""
from __future__ import annotations

# (block_n, block_k): output channels and input columns of the int8 weight tile.
# TPU: a 512 x 2048 int8 tile is 1 MiB (2 MiB double-buffered, 2 MiB more widened to
# bf16), well inside v5e's 16 MiB of scoped VMEM; block_k is a multiple of 128 lanes.
# GPU (Triton): one program per 32 output channels keeps Llama-scale projections
# (N >= 1024) at >= 32 programs, N = 4096 at 128, near one per SM on an H100; each
# loop iteration reads a 32 x 256 int8 tile (8 KiB).
BLOCKS: dict[str, tuple[int, int]] = {"tpu": (512, 2048), "gpu": (32, 256)}
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 3

# rows of x are padded to a multiple of this (bf16 sublane packing on TPU, the smallest
# tl.dot operand on GPU)
ROW_ALIGN = 16

# GGUF block formats (blocks.py). TPU: the whole K axis is one block, so output channels
# per block follow K: at most this many bytes of float32 dequantized tile (576 x 512 for
# SmolLM2, 128 channels at K = 14336), and the scoped VMEM raised to hold it with the
# double-buffered blocks and the widened copy (v5e: 128 MiB of VMEM).
BLOCK_TILE_BYTES = 4 << 20
BLOCK_VMEM_LIMIT = 64 << 20
# GPU: stream columns per loop step (8 scales per step; Q4_K's d and dmin: 2)
GPU_BLOCK_CHUNK = {"q8_0": 256, "q4_0": 128, "q4_1": 128, "q4_k": 256}
