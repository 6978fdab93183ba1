"""Pieces shared by the GPU and TPU ragged paged attention kernels.

Query tiles. Both kernels work on tiles of M "query rows", where a query row is
one (token, query head of a kv group) pair. For kv head k, row r of the batch
owns the flat query rows f = t*G + g for its tokens t (G = N // K heads per kv
head), so a tile of M consecutive flat rows holds ceil(M / G) tokens' worth of
heads that all read the same K/V: GQA costs one KV read per kv head, and a
single decode token still fills G rows of the MMA.

    row r:   tokens qs .. qe-1  ->  flat rows qs*G .. qe*G-1
             | tile 0 (M) | tile 1 (M) | tile 2 (<= M, masked) |

A tile never spans two batch rows, so each tile has one block table and one
kv length. Tiles are packed by an XLA gather into a dense [K, W, M, H] array
(W = cdiv(T*G, M) + R, a static bound) so neither kernel needs dynamic-start
or masked loads of q; the output comes back the same way.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Finite "minus infinity": exp(MASK - MASK) = 1 keeps fully masked rows finite,
# and exp(MASK - real) = 0 wipes them once a real key is seen.
MASK_VALUE = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TileSchedule:
    row: jax.Array    # [W] int32 batch row of the tile (clamped to R-1 for empty tiles)
    f0: jax.Array     # [W] int32 first flat query row of the tile, relative to its row
    n: jax.Array      # [W] int32 valid query rows in the tile (0: empty tile)
    pos0: jax.Array   # [W] int32 position of the row's first new token (= context len)
    kv_len: jax.Array  # [W] int32 seq_len of the tile's row
    src: jax.Array    # [W*M] int32 flat query row (t*G + g) packed at each tile slot


def num_tiles(num_tokens: int, num_rows: int, group: int, block_m: int) -> int:
    """Static upper bound on the number of tiles: sum_r cdiv(q_r*G, M) <= T*G/M + R."""
    return -(-num_tokens * group // block_m) + num_rows


def make_schedule(cu_q_lens: jax.Array, seq_lens: jax.Array, num_tokens: int,
                  group: int, block_m: int) -> TileSchedule:
    """cu_q_lens [R+1], seq_lens [R] -> the tile schedule (traceable; static shapes)."""
    R = seq_lens.shape[0]
    W = num_tiles(num_tokens, R, group, block_m)
    q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    flat_lens = q_lens * group
    tiles_per_row = -(-flat_lens // block_m)
    tile_end = jnp.cumsum(tiles_per_row)                                    # [R] inclusive
    w = jnp.arange(W, dtype=jnp.int32)
    row = jnp.searchsorted(tile_end, w, side="right").astype(jnp.int32)
    real = row < R
    row = jnp.minimum(row, R - 1)
    f0 = (w - (tile_end[row] - tiles_per_row[row])) * block_m
    n = jnp.where(real, jnp.clip(flat_lens[row] - f0, 0, block_m), 0)
    m = jnp.arange(block_m, dtype=jnp.int32)
    src = cu_q_lens[row][:, None] * group + f0[:, None] + m[None, :]
    src = jnp.where(m[None, :] < n[:, None], src, 0).reshape(W * block_m)
    kv_len = seq_lens[row]
    return TileSchedule(row=row, f0=f0, n=n, pos0=kv_len - q_lens[row], kv_len=kv_len,
                        src=src.astype(jnp.int32))


def pack_q(q: jax.Array, sched: TileSchedule, num_kv_heads: int, block_m: int,
           scale: float) -> jax.Array:
    """q [T, N, H] -> scaled tiles [K, W, M, H] (scale applied like the reference)."""
    T, N, H = q.shape
    qf = (q * scale).astype(q.dtype).reshape(T, num_kv_heads, N // num_kv_heads, H)
    qf = qf.transpose(1, 0, 2, 3).reshape(num_kv_heads, T * (N // num_kv_heads), H)
    return qf[:, sched.src].reshape(num_kv_heads, -1, block_m, H)


def unpack_out(out: jax.Array, cu_q_lens: jax.Array, sched: TileSchedule, num_tokens: int,
               group: int, block_m: int) -> jax.Array:
    """Tiles [K, W, M, H] -> [T, N, H]; tokens of no row (padding) get zeros."""
    K, W, M, H = out.shape
    R = cu_q_lens.shape[0] - 1
    f = jnp.arange(num_tokens * group, dtype=jnp.int32)
    t = f // group
    row = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = row < R
    row = jnp.minimum(row, R - 1)
    rel = f - cu_q_lens[row] * group
    tiles_per_row = -(-(jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0) * group) // block_m)
    first_tile = jnp.cumsum(tiles_per_row) - tiles_per_row
    dst = (first_tile[row] + rel // block_m) * block_m + rel % block_m
    dst = jnp.where(valid, dst, 0)
    o = out.reshape(K, W * M, H)[:, dst]
    o = jnp.where(valid[None, :, None], o, 0)
    return o.reshape(K, num_tokens, group, H).transpose(1, 0, 2, 3).reshape(
        num_tokens, K * group, H)


def kv_range(f0, n, pos0, group: int, sliding_window: int | None):
    """[lo, hi) of KV positions any valid query row of a tile can see (hi = lo if n == 0)."""
    hi = pos0 + idiv(f0 + n - 1, group) + 1    # f0 + n - 1 = -1 only when n == 0 (masked)
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        lo = jnp.maximum(pos0 + idiv(f0, group) - sliding_window + 1, 0)
    hi = jnp.where(n > 0, hi, lo)
    return lo, hi


def idiv(a, b: int):
    """a // b for a >= 0 inside kernels: truncating division. jnp's floor division adds a
    sign correction, and Mosaic lowers `sign` by asking the local device for its TPU
    generation, which fails when exporting for TPU from a CPU host (export_check.py)."""
    return jax.lax.div(a, jnp.asarray(b, jnp.int32))


def online_softmax_step(q, k, v, mask, m_prev, l_prev, acc_prev, soft_cap: float | None):
    """One flash-attention update. q [M, H], k/v [B, H], mask [M, B] -> (m, l, acc).

    m, l: [M] float32 running max / denominator; acc [M, H] float32.
    """
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)             # [M, B]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - bcast_col(m_next, s.shape))
    l_next = alpha * l_prev + p.sum(axis=1)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)            # [M, H]
    return m_next, l_next, bcast_col(alpha, pv.shape) * acc_prev + pv


def cache_operands(k_cache, v_cache) -> tuple[list[jax.Array], bool]:
    """The caches as kernel operands: [k, v], or for a quantized cache
    (jaxserve/attention/kv_quant.py QuantizedKV) [k values, v values, k scales, v scales]
    ([K, NB, bs, H] int8 / float8_e4m3fn and [K, NB, bs] float32); and whether quantized."""
    if hasattr(k_cache, "scales"):
        return [k_cache.values, v_cache.values, k_cache.scales.astype(jnp.float32),
                v_cache.scales.astype(jnp.float32)], True
    return [k_cache, v_cache], False


def load_kv(ref, scale_ref, pages, offs, dtype):
    """Slots (pages[i], offs[i]) of one head's cache [NB, bs, H] -> [B, H] in dtype,
    dequantized (value * its slot's scale, in float32) when scale_ref [NB, bs] is given."""
    x = ref[pages, offs, :]
    if scale_ref is None:
        return x.astype(dtype)
    s = scale_ref[pages, offs]
    return (x.astype(jnp.float32) * bcast_col(s, x.shape)).astype(dtype)


def bcast_col(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """[M] -> [M, B] (explicit broadcast_in_dim: lowers on Triton and Mosaic)."""
    return jax.lax.broadcast_in_dim(x, shape, (0,))


def bcast_row(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """[B] -> [M, B]."""
    return jax.lax.broadcast_in_dim(x, shape, (1,))


def tile_mask(f0, n, pos0, kv_pos, group: int, block_m: int,
              sliding_window: int | None) -> jax.Array:
    """[M, B] visibility of KV positions kv_pos [B] for the tile's query rows."""
    m = jnp.arange(block_m, dtype=jnp.int32)
    q_pos = pos0 + (f0 + m) // group                                          # [M]
    shape = (block_m, kv_pos.shape[0])
    qp = bcast_col(q_pos, shape)
    kp = bcast_row(kv_pos, shape)
    ok = (kp <= qp) & bcast_col(m < n, shape)
    if sliding_window is not None:
        ok &= kp > qp - sliding_window
    return ok


def prepare_inputs(q, cu_q_lens, seq_lens, block_tables, *, kv_heads: int, group: int,
                   block_m: int, scale: float):
    """The metadata every kernel variant starts from: int32 lengths and tables (a bucket
    with no KV at all gets one dummy table column, so grids stay non-empty), the tile
    schedule and the packed query tiles. -> (cu_q_lens, seq_lens, block_tables, sched,
    q_tiles)"""
    cu_q_lens, seq_lens = cu_q_lens.astype(jnp.int32), seq_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    if block_tables.shape[1] == 0:
        block_tables = jnp.zeros((block_tables.shape[0], 1), jnp.int32)
    sched = make_schedule(cu_q_lens, seq_lens, q.shape[0], group, block_m)
    return cu_q_lens, seq_lens, block_tables, sched, pack_q(q, sched, kv_heads, block_m, scale)
