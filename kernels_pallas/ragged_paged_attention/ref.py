"""Plain reference for ragged paged attention: one batch row at a time, numpy float64.

Deliberately naive and independent of the kernel's tiling: for each row, gather
its first seq_len cache slots through the block table, build the causal (and
sliding-window) mask from positions, and take a float64 softmax. Host-side
numpy (ragged per-row shapes would make eager jnp compile once per row shape);
for tests and device checks, not for serving.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def ragged_paged_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               cu_q_lens, seq_lens, block_tables, *, scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None) -> np.ndarray:
    """Same contract as kernel.ragged_paged_attention; returns float32 [T, N, H].

    q is scaled and rounded to its dtype first, as the kernels and the jnp
    reference backend do; everything after that is float64.
    """
    T, N, H = q.shape
    K, _, bs, _ = k_cache.shape
    G = N // K
    qs = np.asarray((q * scale).astype(q.dtype).astype(jnp.float32), np.float64)
    kf = np.asarray(k_cache.astype(jnp.float32), np.float64).reshape(K, -1, H)
    vf = np.asarray(v_cache.astype(jnp.float32), np.float64).reshape(K, -1, H)
    cu, lens, tables = np.asarray(cu_q_lens), np.asarray(seq_lens), np.asarray(block_tables)
    out = np.zeros((T, N, H), np.float64)
    for r in range(lens.shape[0]):
        q_len, kv_len = int(cu[r + 1] - cu[r]), int(lens[r])
        if q_len <= 0:
            continue
        k_pos = np.arange(kv_len)
        slots = tables[r, k_pos // bs] * bs + k_pos % bs
        k, v = kf[:, slots], vf[:, slots]                                   # [K, S, H]
        qr = qs[cu[r]:cu[r + 1]].reshape(q_len, K, G, H).transpose(1, 2, 0, 3)  # [K, G, q, H]
        s = qr @ k[:, None].swapaxes(-1, -2)                                  # [K, G, q, S]
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        q_pos = kv_len - q_len + np.arange(q_len)
        ok = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            ok &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = np.where(ok, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = p @ v[:, None]                                                    # [K, G, q, H]
        out[cu[r]:cu[r + 1]] = o.transpose(2, 0, 1, 3).reshape(q_len, N, H)
    return out.astype(np.float32)
