"""TPU (Mosaic) ragged paged attention over a page-major KV cache: one DMA per page
moves every local kv head's K and V, chunks are sized in bytes and triple-buffered,
and the fused KV write is overlapped row by row.

    ragged_paged_attention_pm(q, kv_cache, cu_q_lens, seq_lens, block_tables, *, scale,
                              k_new=None, v_new=None, ...)
        -> out [T, N, H]                      (k_new is None: the cache is only read)
        -> (out, kv_cache)                    (k_new given: new tokens written too)

Cache layout (`to_page_major` converts from the engine's head-major k/v pair):

    kv_cache [NB, 2K, bs, H]    page p holds, for kv head h, its keys at [p, 2h] and
                                its values at [p, 2h + 1], each a [bs, H] tile

One page is one contiguous block of 2 * K * bs * H elements, so one DMA moves all of a
page (every local head, K and V) and the chunk size in bytes is free of the head count.
Inside a page each (head, K/V) is a whole [bs, H] tile, and the DMA scatters a page
into a VMEM chunk buffer [2K, pages, bs, H], so the compute loads each head's K (V) of
a chunk as one contiguous block of natural sublane tiles (no stride-2K sublane loads,
which packed bf16/int8 rows would need with K and V interleaved per token). A quantized cache (kv_quant.QuantizedKV) carries
values [NB, 2K, bs, H] and float32 scales [NB, 2K, bs], one more DMA per page.

Structure (our own code; ideas after tpu-inference's ragged paged attention v3):

* Query tiles as in common.make_schedule; one grid step per tile ("arbitrary": DMAs
  started in one step are waited on in a later one).
* Chunks of `pages_per_chunk` pages, chosen from a byte budget per (chip, head dim,
  dtype, bucket kind) in TUNING. Three VMEM slots: while chunk g is computed, chunks
  g+1 and g+2 are in flight, across tile and row boundaries (the successor of a
  chunk is the next chunk of its tile, else the first chunk of the next tile). A
  chunk's slot is its global number mod 3 (an XLA cumsum over tiles), so no state but
  the DMAs crosses grid steps.
* Pages outside a tile's visible [lo, hi) are not fetched; fully visible chunks skip
  the mask; boundary chunks mask and zero the V rows of unfetched pages.
* Fused KV write: row r's new tokens (one DMA per touched page, all heads, K and V)
  are started when the first chunk of the previous row is issued and waited for just
  before the first chunk of row r is issued, so each row's write overlaps the reads
  and compute of the row before it. Only row 0's write is exposed. Assumes, like any
  paged cache, that a slot written for one row is read by no other row.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention import common
from kernels_pallas.ragged_paged_attention import kernel_tpu_v3 as v3
from kernels_pallas.ragged_paged_attention.pm_tuning import block_sizes

LANES = v3.LANES
SLOTS = 3
FIELDS = v3.FIELDS
_F = {name: i for i, name in enumerate(FIELDS)}


def to_page_major(k_cache: Any, v_cache: Any) -> Any:
    """Head-major k, v [K, NB, bs, H] (or QuantizedKV pairs) -> kv [NB, 2K, bs, H]."""
    if hasattr(k_cache, "scales"):
        return type(k_cache)(to_page_major(k_cache.values, v_cache.values),
                             _interleave(k_cache.scales, v_cache.scales))
    return _interleave(k_cache, v_cache)


def from_page_major(kv_cache: Any) -> tuple[Any, Any]:
    """kv [NB, 2K, bs, H] (or a QuantizedKV of it) -> head-major (k, v) [K, NB, bs, H]."""
    if hasattr(kv_cache, "scales"):
        (kv, vv), (ks, vs) = from_page_major(kv_cache.values), _split(kv_cache.scales)
        return type(kv_cache)(kv, ks), type(kv_cache)(vv, vs)
    return _split(kv_cache)


def _interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    x = jnp.stack([k, v], axis=1)                          # [K, 2, NB, bs, ...]
    x = jnp.moveaxis(x, 2, 0)                              # [NB, K, 2, bs, ...]
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _split(kv: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = kv.reshape(kv.shape[0], -1, 2, *kv.shape[2:])      # [NB, K, 2, bs, ...]
    x = jnp.moveaxis(x, 0, 2)                              # [K, 2, NB, bs, ...]
    return x[:, 0], x[:, 1]


class _Kernel:
    """Refs of one invocation and the steps that use them."""

    def __init__(self, tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref, q_ref, refs, *,
                 group: int, pages_per_chunk: int, sliding_window: int | None,
                 soft_cap: float | None, update: bool, quantized: bool,
                 skip_page: tuple[int, int] | None):
        refs = list(refs)
        take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
        self.kvn = self.sn = self.sc = self.sbuf = self.wsem = None
        if update:
            self.kvn, = take(1)
            if quantized:
                self.sn, = take(1)
            take(1 + quantized)                   # the aliased cache inputs
            self.o_ref, self.kv = take(2)
            if quantized:
                self.sc, = take(1)
        else:
            self.kv, = take(1)
            if quantized:
                self.sc, = take(1)
            self.o_ref, = take(1)
        self.buf, = take(1)
        if quantized:
            self.sbuf, = take(1)
        self.sems, = take(1)
        if update:
            self.wsem, = take(1)
        self.m_sc, self.l_sc, self.acc_sc = refs
        self.quantized, self.update = quantized, update
        self.tiles, self.bt, self.cu, self.seq, self.meta = (tiles_ref, bt_ref, cu_ref,
                                                             seq_ref, meta_ref)
        self.q_ref = q_ref
        self.group, self.ppc = group, pages_per_chunk
        self.window, self.soft_cap, self.skip = sliding_window, soft_cap, skip_page
        self.kv_heads, self.block_m, _ = q_ref.shape
        self.bs = self.kv.shape[2]
        self.chunk = pages_per_chunk * self.bs
        self.num_tiles = tiles_ref.shape[0] // len(FIELDS)
        self.pages_per_row = bt_ref.shape[0] // seq_ref.shape[0]

    def field(self, name: str, w):
        return self.tiles[_F[name] * self.num_tiles + w]

    def heads(self):
        """This kernel's 2K rows of a page (K and V of each local kv head)."""
        return pl.ds(2 * self.meta[1], 2 * self.kv_heads)

    def slot(self, w, c):
        return jax.lax.rem(self.field("c_start", w) + c - self.field("c_lo", w), SLOTS)

    def skipped(self, row, p):
        """The deliberately dropped page (skip_page: negative control for tests)."""
        if self.skip is None:
            return jnp.bool_(False)
        return (row == self.skip[0]) & (p == self.skip[1])

    # -- KV chunk DMAs ---------------------------------------------------------
    def chunk_copies(self, w, c, slot, *, wait: bool) -> None:
        """Start (or wait for) the page DMAs of chunk c of tile w into slot: one DMA
        per visible page (plus one for its scales when quantized), one wait for all."""
        row, bs, ppc = self.field("row", w), self.bs, self.ppc
        p_first = common.idiv(self.field("lo", w), bs)
        p_last = common.idiv(self.field("hi", w) - 1, bs)
        i0 = jnp.clip(p_first - c * ppc, 0, ppc)
        i1 = jnp.clip(p_last + 1 - c * ppc, i0, ppc)

        def page(i, carry):
            p = c * ppc + i

            @pl.when(jnp.logical_not(self.skipped(row, p)))
            def _copy():
                blk = self.bt[row * self.pages_per_row + jnp.minimum(p, self.pages_per_row - 1)]
                copies = [pltpu.make_async_copy(self.kv.at[blk, self.heads()],
                                                self.buf.at[slot, :, i], self.sems.at[slot])]
                if self.quantized:
                    copies.append(pltpu.make_async_copy(
                        self.sc.at[blk, self.heads()], self.sbuf.at[slot, :, pl.ds(i * bs, bs)],
                        self.sems.at[slot]))
                for cp in copies:
                    cp.wait() if wait else cp.start()
            return carry

        if wait and self.skip is None:
            self.wait_chunk(slot, i0, i1)
        else:
            jax.lax.fori_loop(i0, i1, page, 0)

    def wait_chunk(self, slot, i0, i1) -> None:
        """One wait for all of a chunk's pages: a DMA semaphore counts bytes, so a
        descriptor as large as the fetched pages [i0, i1) together waits for them all
        (one scalar wait per chunk instead of one per page)."""
        n = i1 - i0

        @pl.when(n > 0)
        def _wait():
            whole = self.buf.at[slot, :, pl.ds(i0, n)]
            pltpu.make_async_copy(whole, whole, self.sems.at[slot]).wait()
            if self.quantized:
                scales = self.sbuf.at[slot, :, pl.ds(i0 * self.bs, n * self.bs)]
                pltpu.make_async_copy(scales, scales, self.sems.at[slot]).wait()

    def successor(self, w, c):
        """(tile, chunk, exists) of the chunk issued after chunk c of tile w."""
        in_tile = c + 1 < self.field("c_hi", w)
        w1 = jnp.minimum(w + 1, self.num_tiles - 1)
        return (jnp.where(in_tile, w, w1), jnp.where(in_tile, c + 1, self.field("c_lo", w1)),
                in_tile | (w + 1 < self.meta[0]))

    def issue(self, w, c) -> None:
        """Start chunk c of tile w; on a row's first chunk with a fused write, first
        wait for that row's new tokens and start the next row's."""
        if self.update:
            @pl.when((c == self.field("c_lo", w)) & (self.field("f0", w) == 0))
            def _row_start():
                row = self.field("row", w)
                self.write_row(row, wait=True)
                tiles = common.idiv((self.cu[row + 1] - self.cu[row]) * self.group
                                    + self.block_m - 1, self.block_m)
                w_next = w + tiles

                @pl.when(w_next < self.meta[0])
                def _next_row():
                    self.write_row(self.field("row", jnp.minimum(w_next, self.num_tiles - 1)),
                                   wait=False)

        self.chunk_copies(w, c, self.slot(w, c), wait=False)

    # -- fused KV-cache update -------------------------------------------------
    def write_row(self, r, *, wait: bool) -> None:
        """Start (or wait for) one DMA per touched page (all heads, K and V; scales
        beside) copying row r's new tokens (kvn [2K, T, H]) into the cache."""
        bs = self.bs
        q_len = self.cu[r + 1] - self.cu[r]
        seq_len = self.seq[r]
        first = seq_len - q_len

        def page_body(p, carry):
            a = jnp.maximum(first, p * bs)
            b = jnp.minimum(seq_len, (p + 1) * bs)
            t = self.cu[r] + (a - first)
            blk = self.bt[r * self.pages_per_row + p]
            pairs = [(self.kvn.at[:, pl.ds(t, b - a)],
                      self.kv.at[blk, self.heads(), pl.ds(a - p * bs, b - a)])]
            if self.quantized:
                pairs.append((self.sn.at[:, pl.ds(t, b - a)],
                              self.sc.at[blk, self.heads(), pl.ds(a - p * bs, b - a)]))
            for src, dst in pairs:
                cp = pltpu.make_async_copy(src, dst, self.wsem.at[0])
                cp.wait() if wait else cp.start()
            return carry

        p0 = common.idiv(first, bs)
        p1 = jnp.where(q_len > 0, common.idiv(seq_len - 1, bs) + 1, p0)
        jax.lax.fori_loop(p0, p1, page_body, 0)

    # -- attention on one fetched chunk -----------------------------------------
    def compute_chunk(self, w, c, slot) -> None:
        f0, n, pos0 = self.field("f0", w), self.field("n", w), self.field("pos0", w)
        row = self.field("row", w)
        kv0 = c * self.chunk
        q_first = pos0 + common.idiv(f0, self.group)
        q_last = pos0 + common.idiv(f0 + n - 1, self.group)
        full = kv0 + self.chunk <= q_first + 1
        if self.window is not None:
            full &= kv0 >= q_last - self.window + 1
        if self.skip is not None:
            sp = self.skip[1] * self.bs
            full &= jnp.logical_not((row == self.skip[0]) & (sp >= kv0) & (sp < kv0 + self.chunk))

        @pl.when(full)
        def _fast():
            self.heads_update(slot, None)

        @pl.when(jnp.logical_not(full))
        def _masked():
            shape = (self.block_m, self.chunk)
            q_row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
            q_pos = pos0 + common.idiv(f0 + q_row, self.group)
            kv_pos = kv0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
            mask = (kv_pos <= q_pos) & (q_row < n)
            if self.window is not None:
                mask &= kv_pos > q_pos - self.window
            lo_page = common.idiv(self.field("lo", w), self.bs) * self.bs
            hi = self.field("hi", w)
            kv_col = kv0 + jax.lax.broadcasted_iota(jnp.int32, (self.chunk, 1), 0)
            kv_lane = kv0 + jax.lax.broadcasted_iota(jnp.int32, (1, self.chunk), 1)
            fetched = (kv_col >= lo_page) & (kv_col < hi)
            fetched_row = (kv_lane >= lo_page) & (kv_lane < hi)
            if self.skip is not None:
                mask &= jnp.logical_not(self.skipped(row, common.idiv(kv_pos, self.bs)))
                fetched &= jnp.logical_not(self.skipped(row, common.idiv(kv_col, self.bs)))
                fetched_row &= jnp.logical_not(self.skipped(row, common.idiv(kv_lane, self.bs)))
            self.heads_update(slot, mask, fetched, fetched_row)

    def heads_update(self, slot, mask, fetched=None, fetched_row=None) -> None:
        def head(h, carry):
            q = self.q_ref[h]
            # this head's contiguous [ppc, bs, H] tiles -> [chunk, H] (cast first: a
            # merge of whole sublane tiles for every storage dtype)
            k = self.buf[slot, 2 * h].astype(q.dtype).reshape(self.chunk, -1)
            v = self.buf[slot, 2 * h + 1].astype(q.dtype).reshape(self.chunk, -1)
            if fetched is not None:
                v = jnp.where(fetched, v, jnp.zeros_like(v))
            k_scale = v_scale = None
            if self.quantized:
                k_scale = self.sbuf[slot, pl.ds(2 * h, 1), :]
                v_scale = self.sbuf[slot, pl.ds(2 * h + 1, 1), :]
                if fetched_row is not None:
                    v_scale = jnp.where(fetched_row, v_scale, 0.0)
            m, l, acc = v3.softmax_update(q, k, v, mask, self.m_sc[h][:, :1],
                                          self.l_sc[h][:, :1], self.acc_sc[h], self.soft_cap,
                                          k_scale, v_scale)
            self.m_sc[h] = jnp.broadcast_to(m, self.m_sc.shape[1:])
            self.l_sc[h] = jnp.broadcast_to(l, self.l_sc.shape[1:])
            self.acc_sc[h] = acc
            return carry

        jax.lax.fori_loop(0, self.kv_heads, head, 0)

    # -- one grid step = one query tile -------------------------------------------
    def run_tile(self, w) -> None:
        self.m_sc[...] = jnp.full(self.m_sc.shape, common.MASK_VALUE, jnp.float32)
        self.l_sc[...] = jnp.zeros(self.l_sc.shape, jnp.float32)
        self.acc_sc[...] = jnp.zeros(self.acc_sc.shape, jnp.float32)

        def body(c, carry):
            slot = self.slot(w, c)
            self.chunk_copies(w, c, slot, wait=True)
            w1, c1, ok1 = self.successor(w, c)      # already in flight
            w2, c2, ok2 = self.successor(w1, c1)

            @pl.when(ok1 & ok2)
            def _prefetch():
                self.issue(w2, c2)

            self.compute_chunk(w, c, slot)
            return carry

        jax.lax.fori_loop(self.field("c_lo", w), self.field("c_hi", w), body, 0)

        def finish(h, carry):
            l = self.l_sc[h][:, :1]
            self.o_ref[h] = (self.acc_sc[h] / jnp.where(l == 0.0, 1.0, l)).astype(
                self.o_ref.dtype)
            return carry

        jax.lax.fori_loop(0, self.kv_heads, finish, 0)

    def prologue(self) -> None:
        """Grid step 0: row 0's write (exposed), then the first two chunks."""
        if self.update:
            self.write_row(self.field("row", 0), wait=False)
        c0 = self.field("c_lo", 0)
        self.issue(0, c0)
        w1, c1, ok1 = self.successor(0, c0)

        @pl.when(ok1)
        def _second():
            self.issue(w1, c1)


def _kernel(tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref, q_ref, *refs, **static):
    kern = _Kernel(tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref, q_ref, refs, **static)
    w = pl.program_id(0)

    @pl.when((w == 0) & (meta_ref[0] > 0))
    def _prologue():
        kern.prologue()

    @pl.when(w < meta_ref[0])
    def _tile():
        kern.run_tile(w)


def pm_call(q_tiles, kv_cache, sched: common.TileSchedule, block_tables, cu_q_lens,
            seq_lens, *, group: int, pages_per_chunk: int, sliding_window: int | None,
            soft_cap: float | None, interpret: Any, kv_head_offset=None, kv_new=None,
            new_scales=None, skip_page: tuple[int, int] | None = None):
    """q_tiles [K, W, M, H] -> out tiles, or (out tiles, kv_cache) when kv_new
    ([2K, T, H], K and V interleaved like a page) is given."""
    K, W, M, H = q_tiles.shape
    quantized = hasattr(kv_cache, "scales")
    caches = [kv_cache.values, kv_cache.scales.astype(jnp.float32)] if quantized else [kv_cache]
    NB, _, bs, _ = caches[0].shape
    R, P = block_tables.shape
    update = kv_new is not None
    tiles, num_real = v3.tile_fields(sched, group, sliding_window, pages_per_chunk * bs)
    head0 = jnp.int32(0) if kv_head_offset is None else kv_head_offset
    meta = jnp.stack([num_real, jnp.asarray(head0, jnp.int32).reshape(())])

    def tile_map(w, tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref):
        return 0, jnp.minimum(w, jnp.maximum(meta_ref[0] - 1, 0)), 0, 0

    tile_spec = pl.BlockSpec((K, None, M, H), tile_map)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    chunk = pages_per_chunk * bs
    # a page lands strided ([2K] rows of [bs, H] at page i), so each head's K (V) of
    # the chunk is one contiguous [ppc, bs, H] block for the compute
    scratch = [pltpu.VMEM((SLOTS, 2 * K, pages_per_chunk, bs, H), caches[0].dtype)]
    if quantized:
        scratch.append(pltpu.VMEM((SLOTS, 2 * K, chunk), jnp.float32))
    scratch.append(pltpu.SemaphoreType.DMA((SLOTS,)))
    if update:
        scratch.append(pltpu.SemaphoreType.DMA((1,)))
    scratch += [pltpu.VMEM((K, M, LANES), jnp.float32), pltpu.VMEM((K, M, LANES), jnp.float32),
                pltpu.VMEM((K, M, H), jnp.float32)]
    out_tiles = jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype)
    kernel = functools.partial(_kernel, update=update, group=group,
                               pages_per_chunk=pages_per_chunk, sliding_window=sliding_window,
                               soft_cap=soft_cap, quantized=quantized, skip_page=skip_page)
    prefetch = (tiles, block_tables.reshape(R * P), cu_q_lens, seq_lens, meta)
    if update:
        news = [kv_new, *([new_scales] if quantized else [])]
        operands = (q_tiles, *news, *caches)
        in_specs = [tile_spec] + [hbm] * (len(operands) - 1)
        out_specs = [tile_spec] + [hbm] * len(caches)
        out_shape = [out_tiles] + [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]
        first = len(prefetch) + 1 + len(news)     # scalar-prefetch operands count first
        aliases = {first + i: 1 + i for i in range(len(caches))}
    else:
        in_specs = [tile_spec] + [hbm] * len(caches)
        out_specs, out_shape = tile_spec, out_tiles
        operands, aliases = (q_tiles, *caches), {}
    res = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(W,), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=(interpret if isinstance(interpret, pltpu.InterpretParams)
                   else v3.interpret_params(interpret)),
        name="ragged_paged_attention_tpu_pm",
    )(*prefetch, *operands)
    if update and quantized:
        out, values, scales = res
        return out, type(kv_cache)(values, scales)
    return res


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "interpret", "kind", "chip", "block_m",
    "pages_per_chunk", "quantize_new", "skip_page"))
def ragged_paged_attention_pm(q: jax.Array, kv_cache: Any, cu_q_lens: jax.Array,
                              seq_lens: jax.Array, block_tables: jax.Array, *, scale: float,
                              k_new: jax.Array | None = None, v_new: jax.Array | None = None,
                              sliding_window: int | None = None,
                              soft_cap: float | None = None, interpret: Any = False,
                              kind: str | None = None, chip: str | None = None,
                              block_m: int | None = None, pages_per_chunk: int | None = None,
                              kv_head_offset: jax.Array | None = None,
                              quantize_new: Callable[[jax.Array, Any],
                                                     tuple[jax.Array, jax.Array]] | None = None,
                              skip_page: tuple[int, int] | None = None):
    """Ragged paged attention over a page-major cache (see the module docstring).

    Arguments as kernel_tpu_v3.ragged_paged_attention_v3, except the one cache
    kv_cache [NB, 2K, bs, H] (or QuantizedKV) in place of k_cache / v_cache; with
    k_new/v_new [T, K, H] the result is (out, kv_cache) (donate it: in place).
    kv_head_offset: the kernel attends with the single kv head kv_head_offset of
      the cache (q then holds that head's query heads only).
    interpret: True runs the TPU interpreter (pltpu.InterpretParams()); an
      InterpretParams runs it with those settings (tests: detect_races=True).
    pages_per_chunk: overrides the byte budget of pm_tuning.TUNING.
    skip_page: (row, page index) the kernel silently ignores -- a deliberately
      broken variant for testing the block-drop detector; never set it otherwise.
    """
    T, N, H = q.shape
    values = kv_cache.values if hasattr(kv_cache, "scales") else kv_cache
    _, K2, bs, _ = values.shape
    K = K2 // 2 if kv_head_offset is None else 1
    assert N % K == 0 and values.shape[-1] == H and K2 % 2 == 0
    assert (k_new is None) == (v_new is None)
    group = N // K
    R, P = block_tables.shape
    kind = kind or v3.bucket_kind(T, R)
    chip = chip or (v3.chip_generation() if jax.default_backend() == "tpu" else "default")
    bm, ppc = block_sizes(kind, chip, group=group, kv_heads=K, head_dim=H, page_size=bs,
                          dtype=values.dtype, max_pages=max(P, 1))
    block_m, pages_per_chunk = block_m or bm, pages_per_chunk or ppc
    cu_q_lens, seq_lens, block_tables, sched, q_tiles = common.prepare_inputs(
        q, cu_q_lens, seq_lens, block_tables, kv_heads=K, group=group, block_m=block_m,
        scale=scale)
    kv_new = new_scales = None
    if k_new is not None:
        if hasattr(kv_cache, "scales"):
            if quantize_new is None:
                raise ValueError("k_new into a quantized cache needs quantize_new")
            (kq, ks), (vq, vs) = (quantize_new(x, values.dtype) for x in (k_new, v_new))
            kv_new = _new_rows(kq, vq)
            new_scales = _new_rows(ks[..., None], vs[..., None])[..., 0]
        else:
            kv_new = _new_rows(k_new.astype(values.dtype), v_new.astype(values.dtype))
    res = pm_call(q_tiles, kv_cache, sched, block_tables, cu_q_lens, seq_lens, group=group,
                  pages_per_chunk=pages_per_chunk, sliding_window=sliding_window,
                  soft_cap=soft_cap, interpret=interpret, kv_head_offset=kv_head_offset,
                  kv_new=kv_new, new_scales=new_scales, skip_page=skip_page)
    out_tiles = res[0] if k_new is not None else res
    out = common.unpack_out(out_tiles, cu_q_lens, sched, T, group, block_m)
    return (out, res[1]) if k_new is not None else out


def _new_rows(k: jax.Array, v: jax.Array) -> jax.Array:
    """k, v [T, K, H] -> [2K, T, H] with K and V of head h at rows 2h and 2h + 1."""
    T, K, H = k.shape
    return jnp.stack([k, v], axis=2).reshape(T, 2 * K, H).swapaxes(0, 1)
