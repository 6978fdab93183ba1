"""Plain-jnp reference for ragged paged attention: one batch row at a time.

Deliberately naive and independent of the kernel's tiling: for each row, gather
its first seq_len cache slots through the block table, build the causal (and
sliding-window) mask from positions, and take a float32 softmax. Eager only
(row lengths must be concrete); for tests and device checks, not for serving.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def ragged_paged_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               cu_q_lens, seq_lens, block_tables, *, scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None) -> jax.Array:
    """Same contract as kernel.ragged_paged_attention; [T, N, H] in q.dtype."""
    T, N, H = q.shape
    K, _, bs, _ = k_cache.shape
    G = N // K
    cu = np.asarray(cu_q_lens)
    lens = np.asarray(seq_lens)
    tables = np.asarray(block_tables)
    out = jnp.zeros((T, N, H), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    for r in range(lens.shape[0]):
        q_len, kv_len = int(cu[r + 1] - cu[r]), int(lens[r])
        if q_len <= 0:
            continue
        slots = tables[r, np.arange(kv_len) // bs] * bs + np.arange(kv_len) % bs
        k = k_cache.reshape(K, -1, H)[:, slots].astype(jnp.float32)           # [K, S, H]
        v = v_cache.reshape(K, -1, H)[:, slots].astype(jnp.float32)
        qr = (q[cu[r]:cu[r + 1]] * scale).astype(q.dtype).astype(jnp.float32)
        qr = qr.reshape(q_len, K, G, H)
        s = jnp.einsum("qkgh,ksh->kgqs", qr, k, precision=hi)                # [K, G, q, S]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        q_pos = kv_len - q_len + np.arange(q_len)
        k_pos = np.arange(kv_len)
        ok = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            ok &= k_pos[None, :] > q_pos[:, None] - sliding_window
        p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
        o = jnp.einsum("kgqs,ksh->qkgh", p, v, precision=hi).reshape(q_len, N, H)
        out = out.at[cu[r]:cu[r + 1]].set(o)
    return out.astype(q.dtype)
