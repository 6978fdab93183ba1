"""Reference paged attention in plain jnp (the default on CPU).

For each query token, keys come from two places:
  * context: slots already in the KV cache before this step (gathered through the
    row's block table; only when the bucket has P > 0 context blocks);
  * self: the new tokens of this step that belong to the same row, causally.
Both score sets share one softmax. The new K/V are written into the cache first
and attention reads after, so XLA updates the donated cache in place (CPU_PERF.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.attention.metadata import AttentionMetadata

NEG_INF = -1e30


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new k/v [T, K, H] into caches [K, B, bs, H] at flat slots [T]."""
    K, B, bs, H = k_cache.shape
    kf = k_cache.reshape(K, B * bs, H).at[:, slot_mapping].set(
        k.swapaxes(0, 1).astype(k_cache.dtype), mode="drop")
    vf = v_cache.reshape(K, B * bs, H).at[:, slot_mapping].set(
        v.swapaxes(0, 1).astype(v_cache.dtype), mode="drop")
    return kf.reshape(K, B, bs, H), vf.reshape(K, B, bs, H)


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """q [T, N, H], k_new/v_new [T, K, H], caches [K, B, bs, H] -> out [T, N, H].

    The caches must already contain k_new/v_new (see write_kv); context slots
    are those with index < context_lens[row].
    """
    T, N, H = q.shape
    K = k_new.shape[1]
    G = N // K
    qh = (q.reshape(T, K, G, H).transpose(1, 0, 2, 3) * scale).astype(q.dtype)  # [K, T, G, H]
    pos = md.positions
    rows = md.token_rows
    scores = []
    values = []
    P = md.block_tables.shape[1]
    if P > 0:
        _, B, bs, _ = k_cache.shape
        num_rows = md.block_tables.shape[0]
        safe_rows = jnp.minimum(rows, num_rows - 1)
        # Gather whole blocks (contiguous bs x H tiles), not single slots: 16x fewer indices.
        tables = md.block_tables[safe_rows]                                     # [T, P]
        kc = k_cache[:, tables].reshape(K, T, P * bs, H)                        # [K, T, S, H]
        vc = v_cache[:, tables].reshape(K, T, P * bs, H)
        s_ctx = jnp.einsum("ktgh,ktsh->ktgs", qh, kc.astype(q.dtype),
                           preferred_element_type=jnp.float32)
        ctx_len = jnp.where(rows < num_rows, md.context_lens[safe_rows], 0)      # [T]
        sidx = jnp.arange(P * bs, dtype=jnp.int32)
        ok = sidx[None, :] < ctx_len[:, None]
        if sliding_window is not None:
            ok &= sidx[None, :] > pos[:, None] - sliding_window
        scores.append((s_ctx, ok[None, :, None, :]))
        values.append(vc)
    kh = k_new.transpose(1, 0, 2)                                                 # [K, T, H]
    s_self = jnp.einsum("ktgh,ksh->ktgs", qh, kh.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    ok = (rows[:, None] == rows[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        ok &= pos[None, :] > pos[:, None] - sliding_window
    scores.append((s_self, ok[None, :, None, :]))

    masked = []
    for s, ok in scores:
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        masked.append(jnp.where(ok, s, NEG_INF))
    m = masked[0].max(-1)
    for s in masked[1:]:
        m = jnp.maximum(m, s.max(-1))
    probs = [jnp.exp(s - m[..., None]) for s in masked]
    denom = sum(p.sum(-1) for p in probs)
    out = jnp.einsum("ktgs,ksh->ktgh", probs[-1].astype(q.dtype), v_new.transpose(1, 0, 2),
                     preferred_element_type=jnp.float32)
    if values:
        out = out + jnp.einsum("ktgs,ktsh->ktgh", probs[0].astype(q.dtype),
                               values[0].astype(q.dtype), preferred_element_type=jnp.float32)
    out = out / denom[..., None]
    return out.transpose(1, 0, 2, 3).reshape(T, N, H).astype(q.dtype)
