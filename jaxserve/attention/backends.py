"""Attention backend registry: pick the attn_fn the decoder calls.

    get_attention_backend(None | "reference" | "pallas") -> AttentionBackend

Default (None): "pallas" on GPU/TPU, "reference" on CPU (where Pallas only runs
in the slow interpreter).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax


class AttentionBackend(NamedTuple):
    name: str
    attn_fn: Callable[..., jax.Array]
    # True: block_tables must cover seq_lens (context + new tokens), because the
    # kernel reads the new tokens back from the cache. False: context blocks suffice.
    needs_full_block_tables: bool


BACKEND_NAMES = ("reference", "pallas")


def default_backend_name(platform: str | None = None) -> str:
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("gpu", "cuda", "rocm", "tpu") else "reference"


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """Backend by name; None picks by platform. Unknown names raise ValueError."""
    name = default_backend_name() if name is None else name
    if name == "reference":
        from jaxserve.attention import reference
        return AttentionBackend("reference", reference.paged_attention, False)
    if name == "pallas":
        from jaxserve.attention import pallas_backend
        return AttentionBackend("pallas", pallas_backend.paged_attention, True)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
