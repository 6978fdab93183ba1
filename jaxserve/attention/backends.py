"""Attention backend registry: pick the attn_fn the decoder calls.

    get_attention_backend(None | "reference" | "pallas" | "cpu", sharded=False)
        -> AttentionBackend

Default (None): "pallas" on GPU/TPU; on CPU the C++ kernel ("cpu", compiled on first
use; 10x+ faster than the jnp reference on paged contexts) unless no compiler is found
or a sharding plan over several devices is in force, then "reference" (the kernel has no
partitioning rule: XLA would gather its inputs onto every device). A one-device plan
(a data-parallel replica at TP=1) keeps the kernel.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import jax

from jaxserve.attention import kv_layout
from jaxserve.attention.kv_writing import KVWritingAttention, writes_kv

__all__ = ["AttentionBackend", "KVWritingAttention", "writes_kv", "BACKEND_NAMES",
           "default_backend_name", "get_attention_backend"]

log = logging.getLogger("jaxserve")


class AttentionBackend(NamedTuple):
    name: str
    attn_fn: Callable[..., jax.Array]
    # True: block_tables must cover seq_lens (context + new tokens), because the
    # kernel reads the new tokens back from the cache. False: context blocks suffice.
    needs_full_block_tables: bool
    # True: the cost does not grow with the block-table width (the kernel walks each
    # row's own blocks), so one width, the longest row's, is compiled.
    single_table_width: bool = False
    # the KV cache layout attn_fn reads (attention/kv_layout.py): head_major, or
    # page_major for the page-major TPU kernel (tpu_kernel "pm")
    kv_layout: str = "head_major"

    @property
    def writes_kv(self) -> bool:
        """True: attn_fn writes this step's k/v into the caches itself (see writes_kv)."""
        return writes_kv(self.attn_fn)


BACKEND_NAMES = ("reference", "pallas", "cpu")


def default_backend_name(platform: str | None = None, sharded: bool = False) -> str:
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda", "rocm", "tpu"):
        # sharded too: get_attention_backend(plan=...) runs the kernel under shard_map
        return "pallas"
    if sharded:
        return "reference"
    from kernels_cpu.ragged_paged_attention import build
    # available() logs the missing piece once per process, however often this is asked
    return "cpu" if build.available() else "reference"


def get_attention_backend(name: str | None = None, *, sharded: bool = False,
                          plan: Any = None, tpu_kernel: str = "v3") -> AttentionBackend:
    """Backend by name; None picks by platform. Unknown names raise ValueError.

    plan: the ShardingPlan the step runs under (implies sharded); the Pallas kernel
    then runs per device under shard_map over its mesh. tpu_kernel: the Pallas
    backend's TPU kernel (--tpu-attention-kernel); "pm" makes the backend's kv_layout
    page-major on TPU, and on CPU, where the TPU interpreter runs it.
    """
    from jaxserve.parallel.shard import spans_devices
    sharded = sharded or spans_devices(plan)
    name = default_backend_name(sharded=sharded) if name is None else name
    if name == "reference":
        from jaxserve.attention import reference
        return AttentionBackend("reference", reference.paged_attention, False)
    if name == "pallas":
        from jaxserve.attention import pallas_backend
        if sharded and plan is None:
            raise ValueError("the sharded Pallas backend needs the sharding plan "
                             "(get_attention_backend(..., plan=plan))")
        layout = kv_layout.layout_for("pallas", jax.default_backend(), tpu_kernel)
        # the TPU kernels (interpreted on CPU for pm) scalar-prefetch the tables
        single = (pallas_backend.single_table_width()
                  and layout == kv_layout.HEAD_MAJOR)
        return AttentionBackend("pallas", pallas_backend.make_attn_fn(plan=plan,
                                                                      tpu_kernel=tpu_kernel),
                                True, single, layout)
    if name == "cpu":
        from jaxserve.attention import cpu_backend
        from kernels_cpu.ragged_paged_attention import build
        build.load()          # fail at start-up, with the compiler's message, not mid-step
        return AttentionBackend("cpu", cpu_backend.paged_attention, True, True)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
