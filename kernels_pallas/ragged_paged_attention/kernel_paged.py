"""Page-by-page GPU variant of ragged paged attention (Triton backend).

    ragged_paged_attention_paged(q [T, N, H], k_cache/v_cache [K, NB, bs, H],
                                 cu_q_lens [R+1], seq_lens [R], block_tables [R, P],
                                 *, scale, num_splits=1, tiles=None, ...) -> [T, N, H]

Same contract as kernel.ragged_paged_attention. What differs from kernel.py's GPU
kernel is how KV reaches the SM:

  * Page-shaped loads. kernel.py gathers `block_kv` slots through the block table,
    one index per slot (a 64-entry gather whose addresses depend on another gather).
    Here a KV step covers `block_kv` slots as whole pages (bs <= block_kv: block_kv/bs
    pages, each one contiguous [bs, H] load) or as one contiguous run of a page
    (bs > block_kv), so every load is a dense block at an address known from one
    table entry.
  * Page ids read ahead. The loop carries the table entries of the next step: step j
    reads the ids for step j+1 before it loads its own K/V, so the scalar table read is
    off the critical path of the dependent K/V loads.
  * One online-softmax update per step over all its pages (scores per page, one max,
    one rescale), so small pages do not multiply the softmax work.
  * Tiles shared by every layer: the tile schedule (StepTiles: which row, which tokens
    of it, and where each token lands) depends only on the step's lengths, so the
    engine computes it once per step (`make_step_tiles`, from AttentionMetadata) and
    every layer's call reuses it; only the query gather is per layer.
  * Split-K in the same kernel: with num_splits > 1 the grid gains a split axis and
    partials are combined by kernel_splitk.combine_splits. `choose_num_splits` picks the
    count from the work (rows x kv heads x context blocks) and the waves it makes on
    the SMs.

Tiles are counted in tokens: a tile holds up to `block_t` consecutive tokens of one row
with all G query heads of a kv head, i.e. block_t * G query rows, padded to M (a power
of two >= 16, the Triton MMA minimum). Decode buckets use one token per tile (M = G
padded to 16), others 64 // G tokens (M = 64). Launch parameters come from TUNING
(per head dim and dtype), first guesses from shared-memory sizes, not measured.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.ragged_paged_attention import common
from kernels_pallas.ragged_paged_attention.kernel_splitk import combine_splits

DEFAULT_NUM_SMS = 132        # H100 / H200: the default when exporting from a CPU host
MAX_SPLITS = 32
# a split must save at least this fraction of the unsplit cost (the model ignores the
# partials' memory traffic and launch effects; a wave-rounding gain of 1% is noise)
MIN_SPLIT_GAIN = 0.1


class Tuning(NamedTuple):
    block_kv: int            # KV slots per online-softmax step
    num_warps: int
    num_stages: int          # Triton software-pipelining depth of the KV loads


# (head_dim, compute dtype) -> launch parameters. Sized so that num_stages copies of a
# K and a V step fit comfortably in an H100's 228 KiB of shared memory
# (block_kv * H * bytes * 2 * num_stages: 96 KiB for 128 / bf16). Not measured yet.
TUNING: dict[tuple[int, str], Tuning] = {
    (64, "bfloat16"): Tuning(128, 4, 3),
    (128, "bfloat16"): Tuning(64, 4, 3),
    (256, "bfloat16"): Tuning(32, 8, 3),
    (64, "float32"): Tuning(64, 4, 2),
    (128, "float32"): Tuning(32, 4, 2),
    (256, "float32"): Tuning(16, 8, 2),
}
DEFAULT_TUNING = Tuning(64, 4, 2)


def tuning(head_dim: int, dtype: Any) -> Tuning:
    """TUNING's entry for a head dim and q dtype (float16 as bfloat16), else the default."""
    name = jnp.dtype(dtype).name
    name = "bfloat16" if name == "float16" else name
    return TUNING.get((head_dim, name), DEFAULT_TUNING)


# ---- the tile schedule, built once per step ----------------------------------------------

@dataclasses.dataclass
class StepTiles:
    """Query tiles of one step, in tokens (independent of the head counts, so the same
    schedule serves every layer and every tensor-parallel shard)."""
    row: jax.Array           # [W] int32 batch row of the tile (R-1 for empty tiles)
    t0: jax.Array            # [W] int32 first token of the tile, relative to its row
    nt: jax.Array            # [W] int32 tokens in the tile (0: empty tile)
    pos0: jax.Array          # [W] int32 position of the row's first new token
    tok0: jax.Array          # [W] int32 flat index of the tile's first token
    token_tile: jax.Array    # [T] int32 tile of each token (-1: padding token)
    token_slot: jax.Array    # [T] int32 index of the token inside its tile
    block_t: int             # static: tokens per tile


jax.tree_util.register_dataclass(
    StepTiles, data_fields=["row", "t0", "nt", "pos0", "tok0", "token_tile", "token_slot"],
    meta_fields=["block_t"])


def block_tokens(num_tokens: int, num_rows: int, group: int) -> int:
    """Tokens per tile: 1 in decode buckets (T <= R), else 64 // G (64 query rows)."""
    return 1 if num_tokens <= num_rows else max(1, 64 // group)


def tile_rows(group: int, block_t: int) -> int:
    """M: block_t * G query rows rounded up to a power of two, at least 16."""
    return max(16, 1 << (block_t * group - 1).bit_length())


def make_step_tiles(cu_q_lens: jax.Array, seq_lens: jax.Array, num_tokens: int,
                    block_t: int) -> StepTiles:
    """cu_q_lens [R+1], seq_lens [R] -> StepTiles (traceable, static shapes).
    W = cdiv(T, block_t) + R bounds the tiles of any layout of the bucket."""
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    R = seq_lens.shape[0]
    W = -(-num_tokens // block_t) + R
    q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    per_row = -(-q_lens // block_t)
    tile_end = jnp.cumsum(per_row)
    first = tile_end - per_row
    w = jnp.arange(W, dtype=jnp.int32)
    row = jnp.searchsorted(tile_end, w, side="right").astype(jnp.int32)
    real = row < R
    row = jnp.minimum(row, R - 1)
    t0 = (w - first[row]) * block_t
    nt = jnp.where(real, jnp.clip(q_lens[row] - t0, 0, block_t), 0)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    trow = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = trow < R
    trow = jnp.minimum(trow, R - 1)
    rel = t - cu_q_lens[trow]
    return StepTiles(row=row, t0=t0, nt=nt, pos0=seq_lens[row] - q_lens[row],
                     tok0=cu_q_lens[row] + t0,
                     token_tile=jnp.where(valid, first[trow] + rel // block_t, -1),
                     token_slot=rel % block_t, block_t=block_t)


def pack_q(q: jax.Array, tiles: StepTiles, kv_heads: int, M: int, scale: float) -> jax.Array:
    """q [T, N, H] -> scaled tiles [K, W, M, H]; slot m of tile w is token
    tok0[w] + m // G, head m % G of the kv group (zeros past nt[w] * G)."""
    T, N, H = q.shape
    G = N // kv_heads
    qf = (q * scale).astype(q.dtype).reshape(T, kv_heads, G, H)
    qf = qf.transpose(1, 0, 2, 3).reshape(kv_heads, T * G, H)
    m = jnp.arange(M, dtype=jnp.int32)
    src = (tiles.tok0[:, None] + m[None, :] // G) * G + m[None, :] % G
    valid = m[None, :] < tiles.nt[:, None] * G
    src = jnp.where(valid, src, 0).reshape(-1)
    return jnp.where(valid.reshape(1, -1, 1), qf[:, src], 0).reshape(kv_heads, -1, M, H)


def unpack_out(out: jax.Array, tiles: StepTiles, num_tokens: int, group: int) -> jax.Array:
    """Tiles [K, W, M, H] -> [T, N, H]; padding tokens get zeros."""
    K, W, M, H = out.shape
    g = jnp.arange(group, dtype=jnp.int32)
    valid = tiles.token_tile >= 0
    dst = (jnp.maximum(tiles.token_tile, 0) * M + tiles.token_slot * group)[:, None] + g
    o = out.reshape(K, W * M, H)[:, dst.reshape(-1)]                    # [K, T*G, H]
    o = jnp.where(jnp.repeat(valid, group)[None, :, None], o, 0)
    return o.reshape(K, num_tokens, group, H).transpose(1, 0, 2, 3).reshape(
        num_tokens, K * group, H)


# ---- split-K rule ------------------------------------------------------------------------

def num_sms(default: int = DEFAULT_NUM_SMS) -> int:
    """SMs of the local GPU; when exporting from another host, the abstract device's
    core count (jax.sharding.use_abstract_mesh), else the H100/H200 count."""
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        return int(getattr(dev, "core_count", default) or default)
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract is not None and abstract.platform == "gpu" and abstract.num_cores:
        return int(abstract.num_cores)
    return default


def split_cost(programs: int, context_blocks: int, splits: int, sms: int,
               programs_per_sm: int = 2, step_overhead: int = 2) -> float:
    """Analytic time of a split-K launch in KV-step units: waves of
    `sms * programs_per_sm` resident programs, each walking cdiv(C, S) steps plus a fixed
    prologue/epilogue, plus the combine pass (float32 partials, ~1/4 of a step each)."""
    slots = sms * programs_per_sm
    waves = -(-programs * splits // slots)
    cost = waves * (-(-context_blocks // splits) + step_overhead)
    if splits > 1:
        cost += 0.25 * -(-programs * splits // slots)
    return float(cost)


def choose_num_splits(num_tokens: int, num_rows: int, kv_heads: int, context_blocks: int,
                      sms: int = DEFAULT_NUM_SMS) -> int:
    """Static per-bucket split count: decode buckets (T <= R) take the S in 1..32 (at most
    one split per context block) with the least `split_cost` for R x K programs over
    `context_blocks` KV steps (the block table's capacity); ties keep fewer splits, and a
    split must beat no split by MIN_SPLIT_GAIN. Other buckets have enough tiles: 1."""
    if num_tokens > num_rows or context_blocks <= 1:
        return 1
    programs = num_rows * kv_heads
    unsplit = split_cost(programs, context_blocks, 1, sms)
    best, best_cost = 1, unsplit * (1.0 - MIN_SPLIT_GAIN)
    for s in range(2, min(MAX_SPLITS, context_blocks) + 1):
        c = split_cost(programs, context_blocks, s, sms)
        if c <= best_cost and (best == 1 or c < best_cost):
            best, best_cost = s, c
    return best


# ---- the kernel --------------------------------------------------------------------------

def _load_block(ref, scale_ref, head, page, off, size: int, dtype):
    """`size` consecutive slots of one page of a [NB, bs, H] pool (or of head `head` of a
    [KC, NB, bs, H] cache) -> [size, H] in dtype, dequantized by the matching scales when
    given. off is a multiple of size. One indexer per ref: Triton lowers no chains."""
    lead = () if head is None else (head,)
    if size == ref.shape[-2]:
        x = ref[(*lead, page)]
        s = None if scale_ref is None else scale_ref[(*lead, page)]
    else:
        x = ref[(*lead, page, pl.ds(off, size), slice(None))]
        s = None if scale_ref is None else scale_ref[(*lead, page, pl.ds(off, size))]
    if s is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * common.bcast_col(s, x.shape)).astype(dtype)


def _paged_kernel(row_ref, f0_ref, n_ref, pos0_ref,    # [W] int32 tile schedule
                  bt_ref,                              # [R, P] int32 block tables
                  q_ref,                               # [M, H] scaled queries of the tile
                  k_ref, v_ref,                        # [NB, bs, H] (or every head)
                  *rest, group: int, block_kv: int, num_splits: int,
                  sliding_window: int | None, soft_cap: float | None, quantized: bool,
                  head_offset: bool):
    # rest: (k/v scales,) ([1] kv head offset,) then o_ref, or acc/m/l refs when split
    n_out = 3 if num_splits > 1 else 1
    ins, outs = rest[:len(rest) - n_out], rest[len(rest) - n_out:]
    ks_ref, vs_ref = ins[:2] if quantized else (None, None)
    head = ins[-1][0] + pl.program_id(0) if head_offset else None
    w = pl.program_id(1)
    row, f0, n, pos0 = row_ref[w], f0_ref[w], n_ref[w], pos0_ref[w]
    block_m, head_dim = q_ref.shape
    bs = k_ref.shape[-2]
    sub = min(bs, block_kv)                  # slots per contiguous load
    parts = block_kv // sub                  # loads (pages) per step
    max_page = bt_ref.shape[1] - 1
    q = q_ref[...]
    lo, hi = common.kv_range(f0, n, pos0, group, sliding_window)
    j0 = common.idiv(lo, block_kv)
    j1 = common.idiv(hi + block_kv - 1, block_kv)
    if num_splits > 1:
        per_split = common.idiv(j1 - j0 + num_splits - 1, num_splits)
        j0 = j0 + pl.program_id(2) * per_split
        j1 = jnp.maximum(j0, jnp.minimum(j0 + per_split, j1))

    def page_ids(j):
        return tuple(bt_ref[row, jnp.minimum(common.idiv(j * block_kv + i * sub, bs),
                                              max_page)] for i in range(parts))

    def body(j, carry):
        m_prev, l_prev, acc_prev, pages = carry
        ahead = page_ids(j + 1)              # next step's ids, before this step's loads
        scores, values = [], []
        for i in range(parts):
            start = j * block_kv + i * sub
            off = 0 if sub == bs else pl.multiple_of(jax.lax.rem(start, bs), sub)
            k = _load_block(k_ref, ks_ref, head, pages[i], off, sub, q.dtype)  # [sub, H]
            v = _load_block(v_ref, vs_ref, head, pages[i], off, sub, q.dtype)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)     # [M, sub]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kv_pos = start + jnp.arange(sub, dtype=jnp.int32)
            mask = common.tile_mask(f0, n, pos0, kv_pos, group, block_m, sliding_window)
            scores.append(jnp.where(mask, s, common.MASK_VALUE))
            values.append(v)
        m_next = m_prev
        for s in scores:
            m_next = jnp.maximum(m_next, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_next)
        l_next = alpha * l_prev
        acc = common.bcast_col(alpha, acc_prev.shape) * acc_prev
        for s, v in zip(scores, values):
            p = jnp.exp(s - common.bcast_col(m_next, s.shape))
            l_next = l_next + p.sum(axis=1)
            acc = acc + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        return m_next, l_next, acc, ahead

    m0 = jnp.full((block_m,), common.MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((block_m,), jnp.float32)
    acc0 = jnp.zeros((block_m, head_dim), jnp.float32)
    m, l, acc, _ = jax.lax.fori_loop(j0, j1, body, (m0, l0, acc0, page_ids(j0)))
    if num_splits > 1:
        o_ref, m_ref, l_ref = outs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        l = jnp.where(l == 0.0, 1.0, l)
        outs[0][...] = (acc / common.bcast_col(l, acc.shape)).astype(outs[0].dtype)


def _paged_call(q_tiles, k_cache, v_cache, row, f0, n, pos0, block_tables, *, group,
                block_kv, num_splits, sliding_window, soft_cap, num_warps, num_stages,
                interpret, kv_head_offset):
    K, W, M, H = q_tiles.shape
    KC, NB, bs, _ = k_cache.shape
    R, P = block_tables.shape
    S = num_splits
    caches, quantized = common.cache_operands(k_cache, v_cache)
    kernel = functools.partial(_paged_kernel, group=group, block_kv=block_kv, num_splits=S,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               quantized=quantized, head_offset=kv_head_offset is not None)
    grid = (K, W, S) if S > 1 else (K, W)

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda k, w, *s: index(k, w, *s))

    if kv_head_offset is None:
        kv_spec = spec((None, NB, bs, H), lambda k, w, *s: (k, 0, 0, 0))
        scale_spec = spec((None, NB, bs), lambda k, w, *s: (k, 0, 0))
        extra_specs, extra = [], []
    else:   # the caches hold more heads than q reads: the kernel indexes them itself
        kv_spec = spec((KC, NB, bs, H), lambda k, w, *s: (0, 0, 0, 0))
        scale_spec = spec((KC, NB, bs), lambda k, w, *s: (0, 0, 0))
        extra_specs = [spec((1,), lambda k, w, *s: (0,))]
        extra = [jnp.reshape(kv_head_offset, (1,)).astype(jnp.int32)]
    if S > 1:
        out_specs: Any = [spec((None, None, None, M, H), lambda k, w, s: (k, w, s, 0, 0)),
                          spec((None, None, None, M), lambda k, w, s: (k, w, s, 0)),
                          spec((None, None, None, M), lambda k, w, s: (k, w, s, 0))]
        out_shape: Any = [jax.ShapeDtypeStruct((K, W, S, M, H), jnp.float32),
                          jax.ShapeDtypeStruct((K, W, S, M), jnp.float32),
                          jax.ShapeDtypeStruct((K, W, S, M), jnp.float32)]
    else:
        out_specs = spec((None, None, M, H), lambda k, w: (k, w, 0, 0))
        out_shape = jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    whole_1d = spec((W,), lambda k, w, *s: (0,))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole_1d] * 4 + [spec((R, P), lambda k, w, *s: (0, 0)),
                                   spec((None, None, M, H), lambda k, w, *s: (k, w, 0, 0)),
                                   kv_spec, kv_spec, *[scale_spec] * (2 * quantized),
                                   *extra_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="ragged_paged_attention_gpu_paged",
    )(row, f0, n, pos0, block_tables, q_tiles, *caches, *extra)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "interpret", "num_splits", "block_kv",
    "num_warps", "num_stages", "kv_heads"))
def ragged_paged_attention_paged(q: jax.Array, k_cache: Any, v_cache: Any,
                                 cu_q_lens: jax.Array, seq_lens: jax.Array,
                                 block_tables: jax.Array, *, scale: float,
                                 sliding_window: int | None = None,
                                 soft_cap: float | None = None, interpret: bool = False,
                                 num_splits: int | None = 1, block_kv: int | None = None,
                                 num_warps: int | None = None, num_stages: int | None = None,
                                 kv_head_offset: jax.Array | None = None,
                                 kv_heads: int = 1,
                                 tiles: StepTiles | None = None) -> jax.Array:
    """Ragged paged attention with page-shaped KV loads (module docstring); arguments as
    in kernel.ragged_paged_attention, plus:

      num_splits: KV splits per tile (1: no split; None: choose_num_splits for this
        bucket, the table's capacity and the target's SM count).
      block_kv, num_warps, num_stages: default from TUNING for (H, q.dtype). block_kv
        and the page size must be powers of two; on GPU min(bs, block_kv) >= 16.
      kv_head_offset, kv_heads: given an offset, q's heads read the `kv_heads` cache
        heads k_cache[kv_head_offset : kv_head_offset + kv_heads] (a tensor-parallel
        shard of a wider or replicated cache: one or several KV heads per device).
      tiles: the step's StepTiles (make_step_tiles), shared by all layers; built here
        when not given.
    """
    T, N, H = q.shape
    K = k_cache.shape[0] if kv_head_offset is None else kv_heads
    assert N % K == 0 and k_cache.shape == v_cache.shape and k_cache.shape[-1] == H
    group = N // K
    R = seq_lens.shape[0]
    bs = k_cache.shape[2]
    tune = tuning(H, q.dtype)
    block_kv = block_kv or tune.block_kv
    assert block_kv & (block_kv - 1) == 0 and bs & (bs - 1) == 0, (block_kv, bs)
    block_tables = block_tables.astype(jnp.int32)
    if block_tables.shape[1] == 0:
        block_tables = jnp.zeros((R, 1), jnp.int32)
    if num_splits is None:
        context_blocks = -(-block_tables.shape[1] * bs // block_kv)
        num_splits = choose_num_splits(T, R, K, context_blocks, num_sms())
    if tiles is None:
        tiles = make_step_tiles(cu_q_lens, seq_lens, T, block_tokens(T, R, group))
    M = tile_rows(group, tiles.block_t)
    q_tiles = pack_q(q, tiles, K, M, scale)
    out = _paged_call(q_tiles, k_cache, v_cache, tiles.row, tiles.t0 * group,
                      tiles.nt * group, tiles.pos0, block_tables, group=group,
                      block_kv=block_kv, num_splits=num_splits,
                      sliding_window=sliding_window, soft_cap=soft_cap,
                      num_warps=num_warps or tune.num_warps,
                      num_stages=num_stages or tune.num_stages, interpret=interpret,
                      kv_head_offset=kv_head_offset)
    if num_splits > 1:
        out = combine_splits(*out, q.dtype)
    return unpack_out(out, tiles, T, group)
