"""The contract between an attention function and the decoder: whether the function
writes the step's new keys and values into the caches itself. Its own module so the
backends (cpu_backend.py, pallas_backend.py) and the registry that picks them
(backends.py) share it without importing one another."""
from __future__ import annotations

from typing import Any, Callable


class KVWritingAttention:
    """Marks an attn_fn that takes (q, k_new, v_new, k_cache, v_cache, md, **kw) and
    returns (out, k_cache, v_cache) with k_new/v_new written where md.slot_mapping
    points (derived from seq_lens and block_tables, which agree with it): the decoder
    then skips its own scatter (the TPU kernel fuses the write)."""
    __slots__ = ("fn",)
    writes_kv = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def writes_kv(attn_fn: Any) -> bool:
    """Whether attn_fn writes the new k/v itself (KVWritingAttention) rather than
    reading caches the decoder has already written (every other backend)."""
    return bool(getattr(attn_fn, "writes_kv", False))
