"""Pallas attention backend: the ragged paged attention kernel behind the
same attn_fn signature as reference.paged_attention.

The kernel reads every key, the step's new ones included, back from the paged
cache, so this backend needs block tables wide enough for seq_lens, not just the
context (`needs_full_block_tables` in backends.py). On TPU the v3 and pm kernels write
the new keys themselves (paged_attention_update[_pm], fuses_kv_write); elsewhere the
decoder writes them with reference.write_kv first. With the pm kernel the engine's
cache is page-major (attention/kv_layout.py); on CPU the TPU interpreter runs it.

Under a sharding plan the kernel runs per device inside shard_map (make_attn_fn):
neither Mosaic nor Triton calls can be partitioned by XLA.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax

from jaxserve.attention import kv_layout, kv_quant
from jaxserve.attention.kv_writing import KVWritingAttention
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention
from kernels_pallas.ragged_paged_attention import kernel_paged, kernel_splitk

# GPU kernel: "paged" (kernel_paged: page-shaped KV loads, step tiles shared by the
# layers, wave-aware split-K), "gather" (kernel.py's slot gathers, and kernel_splitk
# for small decode buckets) or "mosaic" (kernel_mosaic_gpu on Mosaic GPU for decode
# buckets with pages of 64k slots and unquantized caches, "paged" elsewhere). None has
# run on a GPU yet; JAXSERVE_GPU_ATTENTION picks.
GPU_KERNEL = os.environ.get("JAXSERVE_GPU_ATTENTION", "paged")
# The paged kernel's Triton dots need pages (or runs of a page) of >= 16 slots.
MIN_PAGED_BLOCK = 16

# The TPU kernel is chosen per engine (--tpu-attention-kernel, attention/kv_layout.py):
# "v3" (kernel_tpu_v3: in-kernel KV loops, hand-pipelined page DMAs; the default),
# "tiled" (kernel_tpu: BlockSpec-pipelined pages) or "pm" (kernel_tpu_pm: one DMA per
# page of a page-major cache, which the engine then allocates). None has run on a TPU yet.

# jax platform names -> the kernel variant that lowers there
_VARIANTS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "gpu"}


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, platform: str | None = None,
                    tpu_kernel: str = "v3") -> jax.Array:
    """q [T, N, H], caches [K, B, bs, H] holding k_new/v_new -> out [T, N, H].

    k_new and v_new are unused: the kernel reads them from the cache.
    platform: the platform the step is lowered for (default: JAX's default backend;
    export_check.py lowers for TPU/CUDA from a CPU host). "cpu" runs the Pallas
    interpreter.
    """
    del k_new, v_new
    platform = platform or jax.default_backend()
    if platform not in _VARIANTS:
        raise ValueError(f"the Pallas attention backend has no kernel for {platform!r}")
    bs = k_cache.shape[2]
    block_kv = kernel_paged.tuning(q.shape[2], q.dtype).block_kv
    kernel = kernel_for_bucket(platform, q.shape[0], md.seq_lens.shape[0], k_cache.shape[0],
                               tpu_kernel, context_blocks=-(-md.block_tables.shape[1] * bs // block_kv),
                               page_size=bs, quantized=kv_quant.is_quantized(k_cache))
    kw: dict[str, Any] = {}
    if getattr(kernel, "func", kernel) in _takes_tiles():
        kw["tiles"] = md.kernel_tiles        # None: the kernel builds them itself
    return kernel(
        q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=platform == "cpu", **kw)


def paged_attention_update(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                           k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                           *, scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, interpret: bool = False,
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The v3 TPU kernel with the KV-cache update fused in: k_new/v_new [T, K, H] are
    written into the (aliased) head-major caches by the kernel, so the step has no
    separate XLA scatter. -> (out [T, N, H], k_cache, v_cache).
    interpret: run the TPU interpreter (tests on CPU)."""
    from kernels_pallas.ragged_paged_attention.kernel_tpu_v3 import ragged_paged_attention_v3
    return ragged_paged_attention_v3(
        q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        scale=scale, k_new=k_new, v_new=v_new, sliding_window=sliding_window,
        soft_cap=soft_cap, interpret=interpret, quantize_new=kv_quant.quantize_for_cache)


def paged_attention_update_pm(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                              kv_cache: Any, no_cache: None, md: AttentionMetadata,
                              *, scale: float, sliding_window: int | None = None,
                              soft_cap: float | None = None, interpret: bool = False,
                              ) -> tuple[jax.Array, Any, None]:
    """The page-major TPU kernel on a page-major layer (kv_cache [NB, 2K, bs, H], the
    pair's second slot empty: attention/kv_layout.py), KV update fused in.
    -> (out [T, N, H], kv_cache, None). interpret: the TPU interpreter (CPU)."""
    from kernels_pallas.ragged_paged_attention import kernel_tpu_pm as pm
    assert no_cache is None, "a page-major layer is (kv, None)"
    out, kv = pm.ragged_paged_attention_pm(
        q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale=scale,
        k_new=k_new, v_new=v_new, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=interpret, quantize_new=kv_quant.quantize_for_cache)
    return out, kv, None


def fuses_kv_write(platform: str, tpu_kernel: str = "v3") -> bool:
    """True where the step's kernel writes the new k/v itself: TPU with the v3 or pm kernel
    (sharded or not: under TP each rank writes its own slice of the cache, including
    its own copy of a KV head when TP > K -- parallel/shard.py), and the pm kernel in
    the TPU interpreter on CPU."""
    return kv_layout.layout_for("pallas", platform, tpu_kernel) == kv_layout.PAGE_MAJOR or (
        _VARIANTS.get(platform) == "tpu" and tpu_kernel == "v3")


def kernel_for_bucket(platform: str, num_tokens: int, num_rows: int, kv_heads: int,
                      tpu_kernel: str = "v3", *, context_blocks: int = 128,
                      page_size: int = 16, gpu_kernel: str | None = None,
                      quantized: bool = False) -> Callable[..., jax.Array]:
    """The kernel for one step shape (static, chosen per bucket).

    GPU, GPU_KERNEL "paged" (pages of >= 16 slots): kernel_paged with
    kernel_paged.choose_num_splits(T, R, K, context_blocks) splits (context_blocks: KV
    steps the block table can hold). GPU "gather" (or small pages): split-K for decode
    buckets whose rows x kv heads underfill the SMs (kernel_splitk.choose_num_splits),
    else the tiled kernel. GPU "mosaic": kernel_mosaic_gpu for decode buckets (T <= R)
    with pages of a multiple of 64 slots and unquantized caches, else as "paged".
    TPU: tpu_kernel, v3 or tiled (pm runs only fused: paged_attention_update_pm).
    The CPU interpreter keeps the tiled GPU
    kernel (the other kernels have their own tests)."""
    variant = _VARIANTS[platform]
    gpu_kernel = gpu_kernel or GPU_KERNEL
    if variant == "gpu" and platform != "cpu":
        if (gpu_kernel == "mosaic" and num_tokens <= num_rows and page_size % 64 == 0
                and not quantized):
            from kernels_pallas.ragged_paged_attention import kernel_mosaic_gpu
            return kernel_mosaic_gpu.ragged_paged_attention_mgpu
        if gpu_kernel in ("paged", "mosaic") and page_size >= MIN_PAGED_BLOCK:
            splits = kernel_paged.choose_num_splits(num_tokens, num_rows, kv_heads,
                                                    context_blocks, kernel_paged.num_sms())
            return functools.partial(kernel_paged.ragged_paged_attention_paged,
                                     num_splits=splits)
        splits = kernel_splitk.choose_num_splits(num_tokens, num_rows, kv_heads,
                                                 kernel_splitk.num_sms())
        if splits > 1:
            return functools.partial(kernel_splitk.ragged_paged_attention_splitk,
                                     num_splits=splits)
    if variant == "tpu" and tpu_kernel == "v3":
        from kernels_pallas.ragged_paged_attention.kernel_tpu_v3 import (
                                                                         ragged_paged_attention_v3)
        return ragged_paged_attention_v3
    if variant == "tpu" and tpu_kernel == "pm":
        raise ValueError("the page-major kernel runs only with the fused KV write "
                         "(paged_attention_update_pm)")
    return functools.partial(ragged_paged_attention, backend=variant)


def _takes_tiles() -> tuple[Any, ...]:
    from kernels_pallas.ragged_paged_attention import kernel_mosaic_gpu
    return (kernel_paged.ragged_paged_attention_paged,
            kernel_mosaic_gpu.ragged_paged_attention_mgpu)


def prepare_step(md: AttentionMetadata, num_heads: int, num_kv_heads: int
                 ) -> AttentionMetadata:
    """The paged GPU kernel's query tiles for this step, built once and carried in
    md.kernel_tiles to every layer (they depend on the lengths only, in tokens, so
    tensor-parallel shards share them too)."""
    T, R = md.num_tokens, md.seq_lens.shape[0]
    block_t = kernel_paged.block_tokens(T, R, max(1, num_heads // num_kv_heads))
    return md.replace(kernel_tiles=kernel_paged.make_step_tiles(
        md.query_start_loc, md.seq_lens, T, block_t))


class SharedTilesAttention:
    """An attention function whose per-step tiles are built once (prepare_step, called
    by the decoder before its layers) and then read by every layer's call."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @staticmethod
    def prepare_step(md: AttentionMetadata, num_heads: int,
                     num_kv_heads: int) -> AttentionMetadata:
        return prepare_step(md, num_heads, num_kv_heads)


def single_table_width(platform: str | None = None) -> bool:
    """True where the kernel's work does not depend on the block-table width (the GPU
    kernels gather each row's own pages up to its length; the tables are only read
    through pointers), so the engine compiles one width instead of one per bucket.
    TPU keeps width buckets: the tables are scalar-prefetched into small SMEM."""
    platform = platform or jax.default_backend()
    return platform != "cpu" and _VARIANTS.get(platform) == "gpu"   # not the interpreter


def make_attn_fn(platform: str | None = None, plan: Any = None,
                 tpu_kernel: str = "v3") -> Callable[..., Any]:
    """paged_attention for a platform and, with a ShardingPlan, per device under
    shard_map over the plan's mesh (plan.shard_attention). Where the kernel writes the
    KV cache itself (fuses_kv_write: TPU v3 / pm, pm in the CPU interpreter) the result
    is a backends.KVWritingAttention. tpu_kernel pm: the layers are page-major
    (kv_layout.layout_for says which layout a choice reads). On GPU with the paged
    kernel, a SharedTilesAttention (tiles built once per step)."""
    plat = platform or jax.default_backend()
    layout = kv_layout.layout_for("pallas", plat, tpu_kernel)
    if fuses_kv_write(plat, tpu_kernel):
        fused: Callable[..., Any] = (
            functools.partial(paged_attention_update_pm, interpret=plat == "cpu")
            if layout == kv_layout.PAGE_MAJOR else paged_attention_update)
        if plan is not None:
            fused = plan.shard_attention(fused, writes_kv=True, kv_layout=layout)
        return KVWritingAttention(fused)
    fn: Callable[..., Any] = paged_attention
    if platform is not None or tpu_kernel != "v3":
        fn = functools.partial(paged_attention, platform=platform, tpu_kernel=tpu_kernel)
    fn = fn if plan is None else plan.shard_attention(fn)
    target = platform or jax.default_backend()
    if target != "cpu" and _VARIANTS.get(target) == "gpu" and GPU_KERNEL != "gather":
        return SharedTilesAttention(fn)
    return fn
