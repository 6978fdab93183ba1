"""Reference paged attention in plain jnp (CPU fallback when the C++ kernel cannot be
built, and the backend of sharded plans; see attention/backends.py).

For each query token, keys come from two places:
  * context: slots already in the KV cache before this step, gathered through the
    row's block table (once per token, or once per query tile of a row when the bucket
    carries tiles; only when the bucket has P > 0 context blocks);
  * self: the new tokens of this step that belong to the same row, causally.
Each part yields a partial softmax (max, sum, weighted values) and the two are merged,
flash-attention style. The caller writes the new K/V into the cache first and attention
reads after, so XLA updates the donated cache in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.attention import kv_quant as quant

NEG_INF = -1e30


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new k/v [T, K, H] into caches [K, B, bs, H] at flat slots [T]; a
    quantized cache (attention/kv_quant.py) gets the quantized values and their scales."""
    if quant.is_quantized(k_cache):
        return (quant.write(k_cache, k, slot_mapping), quant.write(v_cache, v, slot_mapping))
    K, B, bs, H = k_cache.shape
    kf = k_cache.reshape(K, B * bs, H).at[:, slot_mapping].set(
        k.swapaxes(0, 1).astype(k_cache.dtype), mode="drop")
    vf = v_cache.reshape(K, B * bs, H).at[:, slot_mapping].set(
        v.swapaxes(0, 1).astype(v_cache.dtype), mode="drop")
    return kf.reshape(K, B, bs, H), vf.reshape(K, B, bs, H)


def _gather(cache, tables: jax.Array, dtype) -> jax.Array:
    """cache[:, tables] -> [K, *tables.shape, bs, H] in dtype (dequantized if quantized)."""
    if quant.is_quantized(cache):
        return quant.gather(cache, tables, dtype)
    return cache[:, tables].astype(dtype)


def _partial(s: jax.Array, ok: jax.Array, v: jax.Array, pv: str, soft_cap: float | None):
    """Masked partial softmax: scores s [..., S] -> (max, sum, sum p*v)."""
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(ok, s, NEG_INF)
    m = s.max(-1)
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum(pv, p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, p.sum(-1), o


def _context_per_token(qh, k_cache, v_cache, md, sliding_window, soft_cap):
    K, T, G, H = qh.shape
    _, B, bs, _ = k_cache.shape
    R, P = md.block_tables.shape
    rows = jnp.minimum(md.token_rows, R - 1)
    tables = md.block_tables[rows]                                   # [T, P]
    kc = _gather(k_cache, tables, qh.dtype).reshape(K, T, P * bs, H)  # [K, T, S, H]
    vc = _gather(v_cache, tables, qh.dtype).reshape(K, T, P * bs, H)
    s = jnp.einsum("ktgh,ktsh->ktgs", qh, kc, preferred_element_type=jnp.float32)
    ctx_len = jnp.where(md.token_rows < R, md.context_lens[rows], 0)  # [T]
    sidx = jnp.arange(P * bs, dtype=jnp.int32)
    ok = sidx[None, :] < ctx_len[:, None]
    if sliding_window is not None:
        ok &= sidx[None, :] > md.positions[:, None] - sliding_window
    return _partial(s, ok[None, :, None, :], vc, "ktgs,ktsh->ktgh", soft_cap)


def _context_tiled(qh, k_cache, v_cache, md, sliding_window, soft_cap):
    K, T, G, H = qh.shape
    _, B, bs, _ = k_cache.shape
    R, P = md.block_tables.shape
    C, Qt = md.tile_tokens.shape
    rows = jnp.minimum(md.tile_rows, R - 1)
    tables = md.block_tables[rows]                                   # [C, P]
    kc = _gather(k_cache, tables, qh.dtype).reshape(K, C, P * bs, H)  # [K, C, S, H]
    vc = _gather(v_cache, tables, qh.dtype).reshape(K, C, P * bs, H)
    q_pad = jnp.concatenate([qh, jnp.zeros((K, 1, G, H), qh.dtype)], axis=1)
    qt = q_pad[:, md.tile_tokens]                                    # [K, C, Qt, G, H]
    s = jnp.einsum("kcqgh,kcsh->kcqgs", qt, kc, preferred_element_type=jnp.float32)
    ctx_len = jnp.where(md.tile_rows < R, md.context_lens[rows], 0)  # [C]
    sidx = jnp.arange(P * bs, dtype=jnp.int32)
    ok = sidx[None, None, :] < ctx_len[:, None, None]                # [C, 1, S]
    if sliding_window is not None:
        pos = jnp.concatenate([md.positions, jnp.zeros(1, jnp.int32)])[md.tile_tokens]
        ok = ok & (sidx[None, None, :] > pos[:, :, None] - sliding_window)
    m, l, o = _partial(s, ok[None, :, :, None, :], vc, "kcqgs,kcsh->kcqgh", soft_cap)
    flat = md.token_tile_slot                                        # [T] into C*Qt
    return (m.reshape(K, C * Qt, G)[:, flat], l.reshape(K, C * Qt, G)[:, flat],
            o.reshape(K, C * Qt, G, H)[:, flat])


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """q [T, N, H], k_new/v_new [T, K, H], caches [K, B, bs, H] -> out [T, N, H].

    Context slots are those with index < context_lens[row]; the new tokens are taken
    from k_new/v_new directly (rounded through the cache's quantization when the cache
    is quantized, so every backend sees the values the cache holds).
    """
    if quant.is_quantized(k_cache):
        kind = quant.kind_of(k_cache.dtype)
        k_new, v_new = quant.fake_quantize(k_new, kind), quant.fake_quantize(v_new, kind)
    T, N, H = q.shape
    K = k_new.shape[1]
    G = N // K
    qh = (q.reshape(T, K, G, H).transpose(1, 0, 2, 3) * scale).astype(q.dtype)  # [K, T, G, H]
    pos, rows = md.positions, md.token_rows
    s = jnp.einsum("ktgh,ksh->ktgs", qh, k_new.transpose(1, 0, 2).astype(q.dtype),
                   preferred_element_type=jnp.float32)
    ok = (rows[:, None] == rows[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        ok &= pos[None, :] > pos[:, None] - sliding_window
    m, l, o = _partial(s, ok[None, :, None, :], v_new.transpose(1, 0, 2).astype(q.dtype),
                       "ktgs,ksh->ktgh", soft_cap)
    if md.block_tables.shape[1] > 0:
        ctx = _context_tiled if md.tile_tokens is not None else _context_per_token
        mc, lc, oc = ctx(qh, k_cache, v_cache, md, sliding_window, soft_cap)
        mm = jnp.maximum(m, mc)
        a, ac = jnp.exp(m - mm), jnp.exp(mc - mm)
        l = l * a + lc * ac
        o = o * a[..., None] + oc * ac[..., None]
    out = o / l[..., None]
    return out.transpose(1, 0, 2, 3).reshape(T, N, H).astype(q.dtype)
