"""The device pool of automaton tables, and the in-step mask and advance.

Every constraint running on the device has its AutomatonTables (device_automaton.py)
copied into one fixed-capacity pool, so the step's shapes never depend on which
constraints are live (no recompiles). Pool state ids are global: a constraint's
states occupy pool rows [base, base + S), its byte transitions stored already offset.

    slot_state [N]         each request slot's pool state; -1: unconstrained
        │ rows' slots          (parked, read as -1, while slot_wait: reasoning_end.py)
        ▼
    masks[state] ──> allowed-token words [R, W] ──> the sampler's token mask
    sampled token ──> its bytes (token_bytes [V, L]) ──> L steps of byte_next,
                      unless the state lists the token as an exception (binary
                      search of its sorted run) ──> slot_state (sampling rows only)

Both happen inside the jitted step, so the device runs ahead (asynchronous
scheduling) without the host seeing a token. The host (DeviceAutomata, below) decides
where a constraint's rows go, uploads them (a small jitted scatter, fixed chunk
shapes), and sets a slot's state when a request (re)starts there: the initial state,
or after preemption the state its kept output tokens lead to (replayed on the host
copy of the tables).

A constraint that starts after a reasoning model's reasoning (reasoning_end.py) sets
the slot's wait flag and its end sequence: while waiting, the row reads as
unconstrained (all-ones mask, no advance) and the step keeps the slot's last
MAX_REASONING_END tokens; the token that completes the end sequence clears the flag,
so the next token is sampled under the constraint's initial state.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from functools import partial

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling.params import MAX_REASONING_END
from jaxserve.structured.device_automaton import MAX_TOKEN_BYTES, AutomatonTables
from jaxserve.structured.range_alloc import RangeAllocator
from jaxserve.structured.reasoning_end import answer_start

STATE_CHUNK = 32          # pool rows per upload call (fixed shapes: one compile)
EXC_CHUNK = 1024          # exception entries per upload call


@struct.dataclass
class AutomatonPool:
    masks: jax.Array          # [P, W] int32 allowed-token bits per pool state
    byte_next: jax.Array      # [P, 256] int32 pool state after one byte
    exc_start: jax.Array      # [P] int32 first pool exception of the state
    exc_len: jax.Array        # [P] int32
    exc_tokens: jax.Array     # [X] int32 sorted within each state's run
    exc_next: jax.Array       # [X] int32 pool state
    token_bytes: jax.Array    # [V, L] uint8 each token's bytes (the vocabulary's)
    token_len: jax.Array      # [V] int32 (0: special tokens, EOS: the state stays)
    slot_state: jax.Array     # [N] int32 pool state of each request slot, -1: none
    slot_wait: jax.Array      # [N] int32 1: the slot's constraint waits for its reasoning end
    slot_end: jax.Array       # [N, E] int32 the end sequence, right-aligned; -1 pads (any)
    slot_recent: jax.Array    # [N, E] int32 the slot's last E tokens while waiting (-1: none)


def init_pool(num_slots: int, vocab_size: int, max_states: int,
              max_token_bytes: int = MAX_TOKEN_BYTES,
              max_exceptions: int = 1 << 16) -> AutomatonPool:
    W = -(-vocab_size // 32)
    z = lambda n: jnp.zeros((n,), jnp.int32)    # noqa: E731
    return AutomatonPool(jnp.zeros((max_states, W), jnp.int32),
                         jnp.zeros((max_states, 256), jnp.int32),
                         z(max_states), z(max_states), z(max_exceptions), z(max_exceptions),
                         jnp.zeros((vocab_size, max_token_bytes), jnp.uint8),
                         jnp.zeros((vocab_size,), jnp.int32),
                         jnp.full((num_slots,), -1, jnp.int32), z(num_slots),
                         jnp.full((num_slots, MAX_REASONING_END), -1, jnp.int32),
                         jnp.full((num_slots, MAX_REASONING_END), -1, jnp.int32))


# ---- in the step --------------------------------------------------------------------------
def row_states(pool: AutomatonPool, slots: jax.Array) -> jax.Array:
    """[R] each row's pool state (-1: unconstrained, or waiting for its reasoning end)."""
    return jnp.where(pool.slot_wait[slots] > 0, -1, pool.slot_state[slots])


def mask_words(pool: AutomatonPool, states: jax.Array) -> jax.Array:
    """[R, W] int32 allowed-token words of each row; all ones for unconstrained rows."""
    words = pool.masks[jnp.maximum(states, 0)]
    return jnp.where((states >= 0)[:, None], words, jnp.int32(-1))


def next_states(pool: AutomatonPool, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """[R] the state each row's token leads to (rows with state -1 stay -1).

    A loop of fixed trip count L over the byte columns, unrolled by 8, gathering from
    the flattened byte table: on XLA:CPU a fully unrolled 2-D gather chain compiles
    far slower (fusion re-evaluates the chain) and a plain loop runs slower a step
    (docs/benchmarks.md, "Measurements behind code choices")."""
    V, L = pool.token_bytes.shape
    tok = jnp.clip(tokens, 0, V - 1)
    n = pool.token_len[tok]
    data = pool.token_bytes[tok].astype(jnp.int32)                 # [R, L]
    flat = pool.byte_next.reshape(-1)

    def byte(i, s):
        b = jax.lax.dynamic_index_in_dim(data, i, axis=1, keepdims=False)
        return jnp.where(i < n, flat[s * 256 + b], s)
    start = jnp.maximum(states, 0)
    s = jax.lax.fori_loop(0, L, byte, start, unroll=8)
    s = _exception(pool, start, tok, s)
    return jnp.where(states >= 0, s, -1)


def _exception(pool: AutomatonPool, states: jax.Array, tokens: jax.Array,
               walked: jax.Array) -> jax.Array:
    """The exception's next state where (state, token) has one, else `walked`: a lower
    bound search of the state's sorted run (a run has at most V entries)."""
    a = pool.exc_start[states]
    end = a + pool.exc_len[states]
    lo, hi = a, end
    top = pool.exc_tokens.shape[0] - 1
    for _ in range(int(pool.token_bytes.shape[0]).bit_length()):
        mid = (lo + hi) // 2
        less = pool.exc_tokens[jnp.clip(mid, 0, top)] < tokens
        open_ = lo < hi
        lo = jnp.where(open_ & less, mid + 1, lo)
        hi = jnp.where(open_ & ~less, mid, hi)
    at = jnp.clip(lo, 0, top)
    hit = (lo < end) & (pool.exc_tokens[at] == tokens)
    return jnp.where(hit, pool.exc_next[at], walked)


def advance(pool: AutomatonPool, slots: jax.Array, tokens: jax.Array,
            valid: jax.Array) -> AutomatonPool:
    """Move each sampling row's slot to the state its sampled token leads to; a row
    waiting for its reasoning end keeps its state and records the token instead."""
    tokens = tokens.astype(jnp.int32)
    states = row_states(pool, slots)
    nxt = next_states(pool, states, tokens)
    idx = jnp.where(valid & (states >= 0), slots, pool.slot_state.shape[0])
    pool = dataclasses.replace(pool, slot_state=pool.slot_state.at[idx].set(nxt, mode="drop"))
    return _watch_reasoning(pool, slots, tokens, valid)


def _watch_reasoning(pool: AutomatonPool, slots: jax.Array, tokens: jax.Array,
                     valid: jax.Array) -> AutomatonPool:
    """Waiting rows: shift the token into the slot's last tokens; the slot stops
    waiting when they end with its end sequence."""
    waiting = valid & (pool.slot_wait[slots] > 0)
    recent = jnp.concatenate([pool.slot_recent[slots][:, 1:], tokens[:, None]], axis=1)
    end = pool.slot_end[slots]
    done = jnp.all((end == recent) | (end < 0), axis=1)
    idx = jnp.where(waiting, slots, pool.slot_wait.shape[0])
    return dataclasses.replace(
        pool, slot_recent=pool.slot_recent.at[idx].set(recent, mode="drop"),
        slot_wait=pool.slot_wait.at[idx].set(jnp.where(done, 0, 1), mode="drop"))


# ---- host -> pool (small jitted updates, the pool donated) --------------------------------
@partial(jax.jit, donate_argnums=(0,))
def _write_states(pool, rows, masks, byte_next, exc_start, exc_len):
    put = lambda a, v: a.at[rows].set(v, mode="drop")   # noqa: E731 - pad rows are dropped
    return dataclasses.replace(pool, masks=put(pool.masks, masks),
                               byte_next=put(pool.byte_next, byte_next),
                               exc_start=put(pool.exc_start, exc_start),
                               exc_len=put(pool.exc_len, exc_len))


@partial(jax.jit, donate_argnums=(0,))
def _write_exceptions(pool, idx, tokens, nxt):
    return dataclasses.replace(pool, exc_tokens=pool.exc_tokens.at[idx].set(tokens, mode="drop"),
                               exc_next=pool.exc_next.at[idx].set(nxt, mode="drop"))


@partial(jax.jit, donate_argnums=(0,))
def _write_vocab(pool, token_bytes, token_len):
    # written into the pool's own buffers, so they keep its placement (sharding)
    return dataclasses.replace(pool, token_bytes=pool.token_bytes.at[:].set(token_bytes),
                               token_len=pool.token_len.at[:].set(token_len))


@partial(jax.jit, donate_argnums=(0,))
def _set_slot(pool, buf):
    # buf: [slot, state, wait, end (E), recent (E)]: one shape, one compile
    slot, E = buf[0], MAX_REASONING_END
    return dataclasses.replace(pool, slot_state=pool.slot_state.at[slot].set(buf[1]),
                               slot_wait=pool.slot_wait.at[slot].set(buf[2]),
                               slot_end=pool.slot_end.at[slot].set(buf[3:3 + E]),
                               slot_recent=pool.slot_recent.at[slot].set(buf[3 + E:]))


def upload(pool: AutomatonPool, tables: AutomatonTables, base: int,
           xbase: int) -> AutomatonPool:
    """Copy `tables` into pool rows [base, base + S), exceptions [xbase, xbase + E)."""
    P, W = pool.masks.shape
    S, E, X = tables.num_states, tables.num_exceptions, pool.exc_tokens.shape[0]

    def chunk(x: np.ndarray, a: int, n: int, size: int, shift: int = 0) -> np.ndarray:
        out = np.zeros((size, *x.shape[1:]), np.int32)
        out[:n] = x[a:a + n] + shift
        return out
    for a in range(0, S, STATE_CHUNK):
        n = min(STATE_CHUNK, S - a)
        rows = np.full(STATE_CHUNK, P, np.int32)
        rows[:n] = np.arange(base + a, base + a + n)
        pool = _write_states(pool, rows, chunk(tables.masks, a, n, STATE_CHUNK),
                             chunk(tables.byte_next, a, n, STATE_CHUNK, base),
                             chunk(tables.exc_start, a, n, STATE_CHUNK, xbase),
                             chunk(tables.exc_len, a, n, STATE_CHUNK))
    for a in range(0, E, EXC_CHUNK):
        n = min(EXC_CHUNK, E - a)
        idx = np.full(EXC_CHUNK, X, np.int32)
        idx[:n] = np.arange(xbase + a, xbase + a + n)
        pool = _write_exceptions(pool, idx, chunk(tables.exc_tokens, a, n, EXC_CHUNK),
                                 chunk(tables.exc_next, a, n, EXC_CHUNK, base))
    return pool


def upload_vocab(pool: AutomatonPool, token_bytes: np.ndarray,
                 token_len: np.ndarray) -> AutomatonPool:
    V, L = pool.token_bytes.shape
    data = np.zeros((V, L), np.uint8)
    w = min(L, token_bytes.shape[1])
    data[:, :w] = token_bytes[:V, :w]      # longer tokens: no constraint may allow them
    return _write_vocab(pool, data, np.asarray(token_len[:V], np.int32))


def set_slot(pool: AutomatonPool, slot: int, state: int, end: tuple[int, ...] = (),
             recent: list[int] | None = None) -> AutomatonPool:
    """Set a slot's state; with `end`, the slot waits for that reasoning end sequence,
    having generated `recent` so far (its last tokens count toward the end)."""
    E = MAX_REASONING_END
    buf = np.full(3 + 2 * E, -1, np.int32)
    buf[:3] = slot, state, 1 if end else 0
    if end:
        buf[3 + E - len(end):3 + E] = end
        tail = (recent or [])[-E:]
        if tail:
            buf[3 + 2 * E - len(tail):] = tail
    return _set_slot(pool, buf)


# ---- host bookkeeping ---------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class _Entry:
    tables: AutomatonTables
    base: int
    xbase: int
    refs: int = 0
    uploaded: bool = False


class DeviceAutomata:
    """Host side of the pool: where each constraint's tables live, which requests use
    them (one copy per distinct constraint, shared), uploads and slot starts.

    attach() reserves pool space when a request is admitted (False: the pool is full,
    the request takes the host path); detach() when it finishes. Unused tables stay
    cached and are evicted (least recently used first) only when space is needed.
    Device memory: max_states * (W + 258) * 4 bytes, max_exceptions * 8, plus
    V * max_token_bytes for the token bytes (28 + 0.5 + 6 MiB with the defaults at
    V = 49152)."""

    def __init__(self, num_slots: int, vocab_size: int, max_states: int = 4096,
                 max_token_bytes: int = MAX_TOKEN_BYTES, max_exceptions: int = 1 << 16
                 ) -> None:
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.max_states, self.max_token_bytes = max_states, max_token_bytes
        self.max_exceptions = max_exceptions
        self._states = RangeAllocator(max_states)
        self._exc = RangeAllocator(max_exceptions)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # key -> entry, LRU order
        self._req_key: dict[str, str] = {}
        self._req_end: dict[str, tuple[int, ...]] = {}    # req_id -> its reasoning end
        self._dirty_slots: set[int] = set()     # slots whose device state is not -1
        self._vocab: np.ndarray | None = None   # the token bytes now in the pool

    def init_pool(self) -> AutomatonPool:
        return init_pool(self.num_slots, self.vocab_size, self.max_states,
                         self.max_token_bytes, self.max_exceptions)

    def attach(self, req_id: str, key: str, tables: AutomatonTables,
               reasoning_end: tuple[int, ...] = ()) -> bool:
        """reasoning_end: the constraint starts after this sequence (reasoning_end.py)."""
        if req_id in self._req_key:
            return True
        if tables.max_token_len > self.max_token_bytes or \
                tables.vocab_size != self.vocab_size:
            return False
        entry = self._entries.get(key) or self._place(key, tables)
        if entry is None:
            return False
        entry.refs += 1
        self._entries.move_to_end(key)
        self._req_key[req_id] = key
        if reasoning_end:
            self._req_end[req_id] = reasoning_end
        return True

    def detach(self, req_id: str) -> None:
        key = self._req_key.pop(req_id, None)
        self._req_end.pop(req_id, None)
        if key is not None:
            self._entries[key].refs -= 1

    def _place(self, key: str, tables: AutomatonTables) -> _Entry | None:
        while True:
            base = self._states.alloc(tables.num_states)
            xbase = self._exc.alloc(tables.num_exceptions) if base is not None else None
            if base is not None and xbase is not None:
                self._entries[key] = e = _Entry(tables, base, xbase)
                return e
            if base is not None:
                self._states.free(base, tables.num_states)
            if not self._evict_one():
                return None

    def _evict_one(self) -> bool:
        for key, e in self._entries.items():          # least recently attached first
            if e.refs == 0:
                self._states.free(e.base, e.tables.num_states)
                self._exc.free(e.xbase, e.tables.num_exceptions)
                del self._entries[key]
                return True
        return False

    def start_slot(self, pool: AutomatonPool, slot: int, req_id: str,
                   output_tokens: list[int]) -> AutomatonPool:
        """A request (re)starts in `slot`: upload its tables if new, set the slot's
        state (initial, or replayed over the outputs it keeps after a preemption; still
        reasoning: initial, waiting for its end sequence)."""
        key = self._req_key.get(req_id)
        if key is None:
            if slot in self._dirty_slots:
                self._dirty_slots.discard(slot)
                pool = set_slot(pool, slot, -1)
            return pool
        e = self._entries[key]
        if self._vocab is not e.tables.token_bytes:
            pool = upload_vocab(pool, e.tables.token_bytes, e.tables.token_len)
            self._vocab = e.tables.token_bytes
        if not e.uploaded:
            pool = upload(pool, e.tables, e.base, e.xbase)
            e.uploaded = True
        self._dirty_slots.add(slot)
        end = self._req_end.get(req_id, ())
        start = answer_start(output_tokens, end)
        if start is None:
            return set_slot(pool, slot, e.base + e.tables.walk([]), end, output_tokens)
        return set_slot(pool, slot, e.base + e.tables.walk(output_tokens[start:]))

    def warmup(self, pool: AutomatonPool, pad_slot: int) -> AutomatonPool:
        """Compile the upload and slot programs (runs them on pad rows / the pad slot)."""
        P, W = pool.masks.shape
        z = np.zeros(STATE_CHUNK, np.int32)
        pool = _write_states(pool, np.full(STATE_CHUNK, P, np.int32),
                             np.zeros((STATE_CHUNK, W), np.int32),
                             np.zeros((STATE_CHUNK, 256), np.int32), z, z)
        ze = np.zeros(EXC_CHUNK, np.int32)
        pool = _write_exceptions(pool, np.full(EXC_CHUNK, pool.exc_tokens.shape[0], np.int32),
                                 ze, ze)
        V, L = pool.token_bytes.shape
        pool = _write_vocab(pool, np.zeros((V, L), np.uint8), np.zeros(V, np.int32))
        self._vocab = None
        return set_slot(pool, pad_slot, -1)
