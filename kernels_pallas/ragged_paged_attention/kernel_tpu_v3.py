"""TPU (Mosaic) ragged paged attention, RPA-v3 class: in-kernel KV loops with
manually double-buffered page DMAs and the KV-cache update fused in.

    ragged_paged_attention_v3(q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables,
                              *, scale, k_new=None, v_new=None, ...)
        -> out [T, N, H]                       (k_new is None: caches only read)
        -> (out, k_cache, v_cache)             (k_new given: new tokens written first)

Same contract as kernel.ragged_paged_attention (rows, positions, masks); see
docs/kernels.md. Structure (our own design, after reading tpu-inference's v3):

* Query tiles come from common.make_schedule (one batch row per tile, all kv heads
  of the tile together). The grid is one step per tile; q / out tiles move through
  BlockSpecs (the Pallas pipeline prefetches the next q tile), surplus empty tiles
  map to the last real tile's block, so they cost neither a DMA nor any math.
* KV lives in HBM (memory_space ANY). Each tile walks its visible KV range in
  chunks of `pages_per_chunk` pages inside the kernel. A chunk is fetched with one
  DMA per page for K and one for V, each covering every kv head of the tile
  (k_cache[h0:h0+K, page]), all signalling the chunk slot's semaphore: K and V of a
  chunk arrive together. Two chunk slots: while chunk i is computed, chunk i+1 is
  in flight -- also across tile (hence sequence) boundaries and grid steps: the
  last chunk of tile w starts the first chunk of tile w+1, and step w+1 waits on it.
  The slot of a chunk is the parity of its global chunk number (an exclusive
  cumsum over tiles computed by XLA beforehand), so no state crosses steps but the
  DMA itself. The grid axis is therefore "arbitrary" (sequential).
* Pages outside [lo, hi) of the tile are not fetched (sliding-window skip, causal
  tail). Chunks wholly visible to every query of the tile take an unmasked path;
  only boundary chunks build the causal / window mask and zero unfetched V rows.
* Fused KV update: with k_new/v_new, grid step 0 first DMAs every row's new tokens
  (one DMA per touched page, all heads) into the caches, which are aliased in/out
  (input_output_aliases: in place when the caller donates them), waits, and only
  then starts reading pages.
* Quantized KV cache (jaxserve/attention/kv_quant.py: int8 / fp8 values + float32 scales
  [K, NB, bs]): each page DMA has a scale DMA beside it (k_scales[h0:h0+K, page] into
  a [2, K, chunk] VMEM buffer, lanes = slots), and the scales are applied to the
  [M, chunk] scores (K) and softmax weights (V) as lane-broadcast rows, so the values
  go to the MXU as they are stored (cast to q's dtype) with no [chunk, H] rescale.
  The fused update quantizes k_new/v_new in XLA first and DMAs values and scales.
* Static specialisation per bucket kind ("decode": T <= R, "prefill": one row,
  else "mixed") and per chip generation (BLOCK_TABLE): the query tile height and the
  KV chunk length. All kinds are correct for any batch; the kind only tunes.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention import common

LANES = 128
# (query rows per tile, KV tokens per chunk) by chip generation and bucket kind.
# Decode is HBM-bound: long chunks (fewer DMA waits, more bytes in flight) and a
# tile just tall enough for one token's GQA group. Prefill/mixed fill the MXU
# (128 rows on v5e's 128x128 MXU, 256 on v6e's 256x256) and keep chunks shorter so
# the [M, chunk] f32 scores stay small. v6e has ~2x v5e's HBM bandwidth: longer
# decode chunks keep more bytes in flight. Unmeasured on hardware (docs/kernels.md).
BLOCK_TABLE: dict[str, dict[str, tuple[int, int]]] = {
    "v5e": {"decode": (16, 512), "prefill": (128, 256), "mixed": (128, 256)},
    "v6e": {"decode": (16, 1024), "prefill": (256, 512), "mixed": (128, 512)},
    "default": {"decode": (16, 512), "prefill": (128, 256), "mixed": (128, 256)},
}
# Double-buffered K+V chunk bytes allowed in VMEM (v5e's default scoped VMEM is 16 MiB).
KV_BUFFER_BYTES = 8 * 2 ** 20
# Per-tile fields packed into one flat SMEM array: field f of tile w at f * W + w.
FIELDS = ("row", "f0", "n", "pos0", "lo", "hi", "c_lo", "c_hi", "c_start")
_F = {name: i for i, name in enumerate(FIELDS)}


def chip_generation(device_kind: str | None = None) -> str:
    """'v5e', 'v6e' or 'default' from a jax device_kind ('TPU v5 lite', 'TPU v6e', ...)."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    kind = device_kind.lower().replace(" ", "")
    if "v5lite" in kind or "v5e" in kind:
        return "v5e"
    if "v6" in kind:
        return "v6e"
    return "default"


def bucket_kind(num_tokens: int, num_rows: int) -> str:
    if num_tokens <= num_rows:
        return "decode"
    return "prefill" if num_rows == 1 else "mixed"


def block_sizes(kind: str, chip: str, *, group: int, kv_heads: int, head_dim: int,
                block_size: int, itemsize: int) -> tuple[int, int]:
    """(block_m, pages_per_chunk) for a bucket kind on a chip generation."""
    block_m, chunk_tokens = BLOCK_TABLE.get(chip, BLOCK_TABLE["default"])[kind]
    if kind == "decode":   # one token's group per tile, sublane-aligned
        block_m = max(block_m, -(-group // 16) * 16)
    per_token = 2 * 2 * kv_heads * head_dim * itemsize    # K + V, two slots
    chunk_tokens = min(chunk_tokens, max(block_size, KV_BUFFER_BYTES // per_token))
    return block_m, max(1, chunk_tokens // block_size)


def tile_fields(sched: common.TileSchedule, group: int, sliding_window: int | None,
                 chunk: int) -> tuple[jax.Array, jax.Array]:
    """Flat [len(FIELDS) * W] per-tile SMEM table and the number of real tiles."""
    lo, hi = common.kv_range(sched.f0, sched.n, sched.pos0, group, sliding_window)
    lo = jnp.broadcast_to(lo, sched.n.shape)       # a scalar 0 without a window
    c_lo = common.idiv(lo, chunk)
    c_hi = jnp.where(sched.n > 0, common.idiv(hi + chunk - 1, chunk), c_lo)
    counts = c_hi - c_lo
    c_start = jnp.cumsum(counts) - counts
    cols = dict(row=sched.row, f0=sched.f0, n=sched.n, pos0=sched.pos0, lo=lo, hi=hi,
                c_lo=c_lo, c_hi=c_hi, c_start=c_start)
    table = jnp.concatenate([jnp.asarray(cols[f], jnp.int32).reshape(-1) for f in FIELDS])
    return table, jnp.sum(sched.n > 0).astype(jnp.int32)


def softmax_update(q, k, v, mask, m_prev, l_prev, acc_prev, soft_cap, k_scale=None,
                    v_scale=None):
    """Flash-attention update with [M, 1] statistics. mask None: every key visible.
    k_scale / v_scale [1, C]: a quantized chunk's per-slot scales."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)           # [M, C]
    if k_scale is not None:
        s = s * k_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    if mask is not None:
        s = jnp.where(mask, s, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    l_next = alpha * l_prev + p.sum(axis=1, keepdims=True)
    if v_scale is not None:
        p = p * v_scale
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)          # [M, H]
    return m_next, l_next, alpha * acc_prev + pv


class _Kernel:
    """The refs of one kernel invocation and the steps that use them (closures over
    refs would make every helper a nested function; this keeps them separate)."""

    def __init__(self, tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref, q_ref, refs, *,
                 group: int, pages_per_chunk: int, sliding_window: int | None,
                 soft_cap: float | None, update: bool, quantized: bool = False):
        refs = list(refs)
        take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
        nq = 2 if quantized else 0     # scale operands beside each k/v pair
        self.ksn = self.vsn = self.ks = self.vs = self.ksbuf = self.vsbuf = None
        if update:
            self.kn, self.vn = take(2)
            if quantized:
                self.ksn, self.vsn = take(2)
            take(2 + nq)                          # the aliased cache inputs
            self.o_ref, self.kc, self.vc = take(3)
        else:
            self.kc, self.vc = take(2)
            if quantized:
                self.ks, self.vs = take(2)
            self.o_ref, = take(1)
        if update and quantized:
            self.ks, self.vs = take(2)
        self.kbuf, self.vbuf = take(2)
        if quantized:
            self.ksbuf, self.vsbuf = take(2)
        self.sems, = take(1)
        if update:
            self.wsem, = take(1)
        self.m_sc, self.l_sc, self.acc_sc = refs
        self.quantized = quantized
        self.tiles, self.bt, self.cu, self.seq, self.meta = (tiles_ref, bt_ref, cu_ref,
                                                             seq_ref, meta_ref)
        self.q_ref = q_ref
        self.group, self.ppc = group, pages_per_chunk
        self.window, self.soft_cap = sliding_window, soft_cap
        self.kv_heads, self.block_m, _ = q_ref.shape
        self.bs = self.kc.shape[2]
        self.chunk = pages_per_chunk * self.bs
        self.num_tiles = tiles_ref.shape[0] // len(FIELDS)
        self.pages_per_row = bt_ref.shape[0] // seq_ref.shape[0]

    def field(self, name: str, w):
        return self.tiles[_F[name] * self.num_tiles + w]

    def heads(self):
        return pl.ds(self.meta[1], self.kv_heads)

    # -- KV chunk DMAs ---------------------------------------------------------
    def chunk_copies(self, w, c, slot, *, wait: bool) -> None:
        """Start (or wait for) the K and V page DMAs of chunk c of tile w into slot."""
        row, bs = self.field("row", w), self.bs
        p_first = common.idiv(self.field("lo", w), bs)
        p_last = common.idiv(self.field("hi", w) - 1, bs)
        for i in range(self.ppc):
            p = c * self.ppc + i

            @pl.when((p >= p_first) & (p <= p_last))
            def _copy():
                page = self.bt[row * self.pages_per_row + jnp.minimum(p, self.pages_per_row - 1)]
                pairs = [(self.kc, self.kbuf), (self.vc, self.vbuf)]
                if self.quantized:
                    pairs += [(self.ks, self.ksbuf), (self.vs, self.vsbuf)]
                for src, dst in pairs:
                    cp = pltpu.make_async_copy(src.at[self.heads(), page],
                                               dst.at[slot, :, pl.ds(i * bs, bs)],
                                               self.sems.at[slot])
                    cp.wait() if wait else cp.start()

    # -- fused KV-cache update -------------------------------------------------
    def write_new_kv(self, *, wait: bool) -> None:
        """Start (or wait for) one DMA per (row, touched page) per K/V copying the
        row's new tokens (kn/vn [K, T, H]) into the caches."""
        bs = self.bs

        def row_body(r, carry):
            q_len = self.cu[r + 1] - self.cu[r]
            seq_len = self.seq[r]
            first = seq_len - q_len

            def page_body(p, carry):
                a = jnp.maximum(first, p * bs)
                b = jnp.minimum(seq_len, (p + 1) * bs)
                t = self.cu[r] + (a - first)
                page = self.bt[r * self.pages_per_row + p]
                pairs = [(self.kn, self.kc), (self.vn, self.vc)]
                if self.quantized:
                    pairs += [(self.ksn, self.ks), (self.vsn, self.vs)]
                for src, dst in pairs:
                    cp = pltpu.make_async_copy(src.at[:, pl.ds(t, b - a)],
                                               dst.at[self.heads(), page, pl.ds(a - p * bs, b - a)],
                                               self.wsem.at[0])
                    cp.wait() if wait else cp.start()
                return carry

            p0 = common.idiv(first, bs)
            p1 = jnp.where(q_len > 0, common.idiv(seq_len - 1, bs) + 1, p0)
            return jax.lax.fori_loop(p0, p1, page_body, carry)

        jax.lax.fori_loop(0, self.seq.shape[0], row_body, 0)

    # -- attention on one fetched chunk -----------------------------------------
    def compute_chunk(self, w, c, slot) -> None:
        """Online-softmax update of every head of tile w with chunk c (in slot)."""
        f0, n, pos0 = self.field("f0", w), self.field("n", w), self.field("pos0", w)
        kv0 = c * self.chunk
        q_first = pos0 + common.idiv(f0, self.group)
        q_last = pos0 + common.idiv(f0 + n - 1, self.group)
        full = kv0 + self.chunk <= q_first + 1     # every key visible to every query
        if self.window is not None:
            full &= kv0 >= q_last - self.window + 1

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
            # pages outside [lo, hi) were not fetched: their V rows hold stale (maybe
            # non-finite) data, and p = 0 times NaN is still NaN
            lo_page = common.idiv(self.field("lo", w), self.bs) * self.bs
            hi = self.field("hi", w)
            kv_col = kv0 + jax.lax.broadcasted_iota(jnp.int32, (self.chunk, 1), 0)
            fetched = (kv_col >= lo_page) & (kv_col < hi)
            kv_lane = kv0 + jax.lax.broadcasted_iota(jnp.int32, (1, self.chunk), 1)
            self.heads_update(slot, mask, fetched, (kv_lane >= lo_page) & (kv_lane < hi))

    def heads_update(self, slot, mask, fetched=None, fetched_row=None) -> None:
        def head(h, carry):
            q = self.q_ref[h]
            k = self.kbuf[slot, h].astype(q.dtype)
            v = self.vbuf[slot, h].astype(q.dtype)
            if fetched is not None:
                v = jnp.where(fetched, v, jnp.zeros_like(v))
            k_scale = v_scale = None
            if self.quantized:     # [1, chunk] rows; unfetched slots' scales are stale
                k_scale = self.ksbuf[slot, pl.ds(h, 1), :]
                v_scale = self.vsbuf[slot, pl.ds(h, 1), :]
                if fetched_row is not None:
                    v_scale = jnp.where(fetched_row, v_scale, 0.0)
            m, l, acc = softmax_update(q, k, v, mask, self.m_sc[h][:, :1],
                                        self.l_sc[h][:, :1], self.acc_sc[h], self.soft_cap,
                                        k_scale, v_scale)
            self.m_sc[h] = jnp.broadcast_to(m, self.m_sc.shape[1:])
            self.l_sc[h] = jnp.broadcast_to(l, self.l_sc.shape[1:])
            self.acc_sc[h] = acc
            return carry

        jax.lax.fori_loop(0, self.kv_heads, head, 0)

    # -- one grid step = one query tile -------------------------------------------
    def run_tile(self, w) -> None:
        num_real = self.meta[0]
        self.m_sc[...] = jnp.full(self.m_sc.shape, common.MASK_VALUE, jnp.float32)
        self.l_sc[...] = jnp.zeros(self.l_sc.shape, jnp.float32)
        self.acc_sc[...] = jnp.zeros(self.acc_sc.shape, jnp.float32)
        c_lo, c_hi = self.field("c_lo", w), self.field("c_hi", w)
        w_next = jnp.minimum(w + 1, self.num_tiles - 1)

        def body(c, carry):
            slot = jax.lax.rem(self.field("c_start", w) + c - c_lo, 2)
            self.chunk_copies(w, c, slot, wait=True)
            more_here = c + 1 < c_hi

            @pl.when(more_here)
            def _next_chunk():
                self.chunk_copies(w, c + 1, 1 - slot, wait=False)

            @pl.when(jnp.logical_not(more_here) & (w + 1 < num_real))
            def _next_tile():      # across the tile (and maybe sequence) boundary
                self.chunk_copies(w_next, self.field("c_lo", w_next), 1 - slot, wait=False)

            self.compute_chunk(w, c, slot)
            return carry

        jax.lax.fori_loop(c_lo, c_hi, body, 0)

        def finish(h, carry):
            l = self.l_sc[h][:, :1]
            out = self.acc_sc[h] / jnp.where(l == 0.0, 1.0, l)
            self.o_ref[h] = out.astype(self.o_ref.dtype)
            return carry

        jax.lax.fori_loop(0, self.kv_heads, finish, 0)


def _kernel(tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref, q_ref, *refs, update: bool,
            **static):
    kern = _Kernel(tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref, q_ref, refs,
                   update=update, **static)
    w = pl.program_id(0)

    @pl.when(w == 0)
    def _prologue():
        if update:      # every new token lands before any page is read
            kern.write_new_kv(wait=False)
            kern.write_new_kv(wait=True)

        @pl.when(meta_ref[0] > 0)
        def _first_chunk():
            kern.chunk_copies(0, kern.field("c_lo", 0), 0, wait=False)

    @pl.when(w < meta_ref[0])
    def _tile():
        kern.run_tile(w)


def interpret_params(interpret: bool):
    # the TPU interpreter models DMAs and semaphores; plain interpret=True does not
    return pltpu.InterpretParams() if interpret else False


def v3_call(q_tiles, k_cache, v_cache, sched: common.TileSchedule, block_tables,
            cu_q_lens, seq_lens, *, group: int, pages_per_chunk: int,
            sliding_window: int | None, soft_cap: float | None, interpret: bool,
            kv_head_offset=None, k_new_t=None, v_new_t=None, new_scales=None):
    """q_tiles [K, W, M, H] -> out tiles (and the updated caches when k_new_t, the
    new keys as [K, T, H], is given). A quantized cache (QuantizedKV) comes back as
    one, and its new tokens' scales are new_scales ([K, T] f32 for k and for v)."""
    K, W, M, H = q_tiles.shape
    bs = k_cache.shape[2]
    R, P = block_tables.shape
    update = k_new_t is not None
    caches, quantized = common.cache_operands(k_cache, v_cache)
    nq = 2 if quantized else 0
    tiles, num_real = tile_fields(sched, group, sliding_window, pages_per_chunk * bs)
    head0 = jnp.int32(0) if kv_head_offset is None else kv_head_offset
    meta = jnp.stack([num_real, jnp.asarray(head0, jnp.int32).reshape(())])

    def tile_map(w, tiles_ref, bt_ref, cu_ref, seq_ref, meta_ref):
        return 0, jnp.minimum(w, jnp.maximum(meta_ref[0] - 1, 0)), 0, 0

    tile_spec = pl.BlockSpec((K, None, M, H), tile_map)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    chunk = pages_per_chunk * bs
    scratch = [pltpu.VMEM((2, K, chunk, H), k_cache.dtype),
               pltpu.VMEM((2, K, chunk, H), v_cache.dtype)]
    scratch += [pltpu.VMEM((2, K, chunk), jnp.float32)] * nq
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    if update:
        scratch.append(pltpu.SemaphoreType.DMA((1,)))
    scratch += [pltpu.VMEM((K, M, LANES), jnp.float32), pltpu.VMEM((K, M, LANES), jnp.float32),
                pltpu.VMEM((K, M, H), jnp.float32)]
    out_tiles = jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype)
    kernel = functools.partial(_kernel, update=update, group=group,
                               pages_per_chunk=pages_per_chunk,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               quantized=quantized)
    prefetch = (tiles, block_tables.reshape(R * P), cu_q_lens, seq_lens, meta)
    if update:
        news = [k_new_t, v_new_t, *(new_scales if quantized else ())]
        operands = (q_tiles, *news, *caches)
        in_specs = [tile_spec] + [hbm] * (len(operands) - 1)
        out_specs = [tile_spec] + [hbm] * len(caches)
        out_shape = [out_tiles] + [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]
        # operand indices count the scalar-prefetch arguments first
        first = len(prefetch) + 1 + len(news)
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
        # sequential: a tile waits on the chunk DMA its predecessor started
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret_params(interpret),
        name="ragged_paged_attention_tpu_v3",
    )(*prefetch, *operands)
    if update and quantized:     # values and scales back into QuantizedKV pytrees
        out, kv, vv, ks, vs = res
        return out, type(k_cache)(kv, ks), type(v_cache)(vv, vs)
    return res


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "interpret", "kind", "chip", "block_m",
    "pages_per_chunk", "quantize_new"))
def ragged_paged_attention_v3(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                              cu_q_lens: jax.Array, seq_lens: jax.Array,
                              block_tables: jax.Array, *, scale: float,
                              k_new: jax.Array | None = None, v_new: jax.Array | None = None,
                              sliding_window: int | None = None,
                              soft_cap: float | None = None, interpret: bool = False,
                              kind: str | None = None, chip: str | None = None,
                              block_m: int | None = None, pages_per_chunk: int | None = None,
                              kv_head_offset: jax.Array | None = None,
                              quantize_new: Callable[[jax.Array, Any],
                                                     tuple[jax.Array, jax.Array]] | None = None):
    """Ragged paged attention on TPU (see the module docstring).

    Same arguments as kernel.ragged_paged_attention, plus:
      k_new, v_new: [T, K, H] this step's keys/values. Given, row r's tokens are first
        written to the caches at positions seq_lens[r] - q_len .. seq_lens[r] - 1 of its
        block table (tokens of no row are dropped) and (out, k_cache, v_cache) is
        returned; donate the caches so the update is in place.
      kind: "decode" | "prefill" | "mixed" tuning; default from the bucket (T <= R:
        decode, R == 1: prefill, else mixed).
      chip: "v5e" | "v6e" | "default" block-size table row; default from the device
        (export from CPU: pass it).
      block_m, pages_per_chunk: override the table.
      quantize_new: (x [..., H], the cache's storage dtype) -> (values, float32 scales
        [...]), how k_new / v_new are stored in a quantized cache; needed with k_new
        and a quantized cache (the cache format is its owner's, not the kernel's).
    """
    T, N, H = q.shape
    KC, _, bs, _ = k_cache.shape
    K = KC if kv_head_offset is None else 1
    assert N % K == 0 and k_cache.shape == v_cache.shape and k_cache.shape[-1] == H
    assert (k_new is None) == (v_new is None)
    group = N // K
    R = seq_lens.shape[0]
    kind = kind or bucket_kind(T, R)
    chip = chip or (chip_generation() if jax.default_backend() == "tpu" else "default")
    bm, ppc = block_sizes(kind, chip, group=group, kv_heads=K, head_dim=H, block_size=bs,
                          itemsize=jnp.dtype(k_cache.dtype).itemsize)
    block_m, pages_per_chunk = block_m or bm, pages_per_chunk or ppc
    cu_q_lens, seq_lens, block_tables, sched, q_tiles = common.prepare_inputs(
        q, cu_q_lens, seq_lens, block_tables, kv_heads=K, group=group, block_m=block_m,
        scale=scale)
    new_t, new_scales = [None, None], None
    if k_new is not None and hasattr(k_cache, "scales"):     # quantized: in XLA, first
        if quantize_new is None:
            raise ValueError("k_new into a quantized cache needs quantize_new")
        (kq, ks), (vq, vs) = (quantize_new(x, k_cache.dtype) for x in (k_new, v_new))
        new_t = [kq.swapaxes(0, 1), vq.swapaxes(0, 1)]
        new_scales = [ks.swapaxes(0, 1), vs.swapaxes(0, 1)]
    elif k_new is not None:
        new_t = [x.swapaxes(0, 1).astype(k_cache.dtype) for x in (k_new, v_new)]
    res = v3_call(q_tiles, k_cache, v_cache, sched, block_tables, cu_q_lens, seq_lens,
                  group=group, pages_per_chunk=pages_per_chunk,
                  sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
                  kv_head_offset=kv_head_offset, k_new_t=new_t[0], v_new_t=new_t[1],
                  new_scales=new_scales)
    out_tiles = res[0] if k_new is not None else res
    out = common.unpack_out(out_tiles, cu_q_lens, sched, T, group, block_m)
    return (out, res[1], res[2]) if k_new is not None else out
