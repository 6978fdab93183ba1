"""The device pool of automaton tables, and the in-step mask and advance.

Every constraint running on the device has its AutomatonTables (device_automaton.py)
copied into one fixed-capacity pool, so the step's shapes never depend on which
constraints are live (no recompiles). Pool state ids are global: a constraint's
states occupy pool rows [base, base + S), its exceptions [xbase, xbase + E), and its
next-state entries are stored already offset.

    slot_state [N]         each request slot's pool state; -1: unconstrained
        │ rows' slots
        ▼
    masks[state] ──> allowed-token words [R, W] ──> sampler (-inf where a bit is 0)
    sampled token ──> next state: binary search of the state's exception run,
                      else default_next ──> slot_state (valid rows only)

Both happen inside the jitted step, so the device runs ahead (asynchronous
scheduling) without the host seeing a token. The host (DeviceAutomata, below) decides
where a constraint's rows go, uploads them (a small jitted scatter, fixed chunk
shapes), and sets a slot's state when a request (re)starts there: the initial state,
or after preemption the state its kept output tokens lead to (replayed on the host
copy of the tables).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.structured.device_automaton import AutomatonTables
from jaxserve.structured.range_alloc import RangeAllocator

STATE_CHUNK = 32          # pool rows per upload call (fixed shapes: one compile)
EXC_CHUNK = 4096          # exception entries per upload call


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AutomatonPool:
    masks: jax.Array          # [P, W] int32 allowed-token bits per pool state
    default_next: jax.Array   # [P] int32 pool state an allowed non-exception token leads to
    exc_start: jax.Array      # [P] int32 first pool exception of the state
    exc_len: jax.Array        # [P] int32
    exc_tokens: jax.Array     # [X] int32 sorted within each state's run
    exc_next: jax.Array       # [X] int32 pool state
    slot_state: jax.Array     # [N] int32 pool state of each request slot, -1: none


def init_pool(num_slots: int, vocab_size: int, max_states: int,
              max_exceptions: int) -> AutomatonPool:
    W = -(-vocab_size // 32)
    z = lambda *s: jnp.zeros(s, jnp.int32)   # noqa: E731
    return AutomatonPool(z(max_states, W), z(max_states), z(max_states), z(max_states),
                         z(max_exceptions), z(max_exceptions),
                         jnp.full((num_slots,), -1, jnp.int32))


# ---- in the step --------------------------------------------------------------------------
def row_states(pool: AutomatonPool, slots: jax.Array) -> jax.Array:
    """[R] each row's pool state (-1: unconstrained)."""
    return pool.slot_state[slots]


def mask_words(pool: AutomatonPool, states: jax.Array) -> jax.Array:
    """[R, W] int32 allowed-token words of each row; all ones for unconstrained rows."""
    words = pool.masks[jnp.maximum(states, 0)]
    return jnp.where((states >= 0)[:, None], words, jnp.int32(-1))


def next_states(pool: AutomatonPool, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """[R] the state each row's token leads to (rows with state -1 stay -1)."""
    s = jnp.maximum(states, 0)
    a = pool.exc_start[s]
    end = a + pool.exc_len[s]
    lo, hi = a, end
    top = pool.exc_tokens.shape[0] - 1
    # lower bound of the token in the state's sorted run; a run has at most V entries
    for _ in range(int(pool.masks.shape[1] * 32).bit_length()):
        mid = (lo + hi) // 2
        less = pool.exc_tokens[jnp.clip(mid, 0, top)] < tokens
        open_ = lo < hi
        lo = jnp.where(open_ & less, mid + 1, lo)
        hi = jnp.where(open_ & ~less, mid, hi)
    at = jnp.clip(lo, 0, top)
    hit = (lo < end) & (pool.exc_tokens[at] == tokens)
    nxt = jnp.where(hit, pool.exc_next[at], pool.default_next[s])
    return jnp.where(states >= 0, nxt, -1)


def advance(pool: AutomatonPool, slots: jax.Array, tokens: jax.Array,
            valid: jax.Array) -> AutomatonPool:
    """Move each sampling row's slot to the state its sampled token leads to."""
    states = row_states(pool, slots)
    nxt = next_states(pool, states, tokens.astype(jnp.int32))
    idx = jnp.where(valid & (states >= 0), slots, pool.slot_state.shape[0])
    return dataclasses.replace(pool, slot_state=pool.slot_state.at[idx].set(nxt, mode="drop"))


# ---- host -> pool (small jitted updates, the pool donated) --------------------------------
@partial(jax.jit, donate_argnums=(0,))
def _write_states(pool, rows, masks, default_next, exc_start, exc_len):
    put = lambda a, v: a.at[rows].set(v, mode="drop")   # noqa: E731 - pad rows are dropped
    return dataclasses.replace(pool, masks=put(pool.masks, masks),
                               default_next=put(pool.default_next, default_next),
                               exc_start=put(pool.exc_start, exc_start),
                               exc_len=put(pool.exc_len, exc_len))


@partial(jax.jit, donate_argnums=(0,))
def _write_exceptions(pool, idx, tokens, nxt):
    return dataclasses.replace(pool, exc_tokens=pool.exc_tokens.at[idx].set(tokens, mode="drop"),
                               exc_next=pool.exc_next.at[idx].set(nxt, mode="drop"))


@partial(jax.jit, donate_argnums=(0,))
def _set_slot(pool, slot_and_state):
    slot, state = slot_and_state[0], slot_and_state[1]
    return dataclasses.replace(pool, slot_state=pool.slot_state.at[slot].set(state))


def upload(pool: AutomatonPool, tables: AutomatonTables, base: int,
           xbase: int) -> AutomatonPool:
    """Copy `tables` into pool rows [base, base + S) and exceptions [xbase, xbase + E)."""
    P, X = pool.default_next.shape[0], pool.exc_tokens.shape[0]
    S, E, W = tables.num_states, tables.num_exceptions, pool.masks.shape[1]
    for a in range(0, S, STATE_CHUNK):
        n = min(STATE_CHUNK, S - a)
        rows = np.full(STATE_CHUNK, P, np.int32)
        rows[:n] = np.arange(base + a, base + a + n)
        pad = lambda x, shape: np.concatenate(    # noqa: E731
            [x[a:a + n], np.zeros((STATE_CHUNK - n, *shape), np.int32)])
        pool = _write_states(pool, rows, pad(tables.masks, (W,)),
                             pad(tables.default_next + base, ()),
                             pad(tables.exc_start + xbase, ()), pad(tables.exc_len, ()))
    for a in range(0, E, EXC_CHUNK):
        n = min(EXC_CHUNK, E - a)
        idx = np.full(EXC_CHUNK, X, np.int32)
        idx[:n] = np.arange(xbase + a, xbase + a + n)
        tok = np.zeros(EXC_CHUNK, np.int32)
        tok[:n] = tables.exc_tokens[a:a + n]
        nxt = np.zeros(EXC_CHUNK, np.int32)
        nxt[:n] = tables.exc_next[a:a + n] + base
        pool = _write_exceptions(pool, idx, tok, nxt)
    return pool


def set_slot(pool: AutomatonPool, slot: int, state: int) -> AutomatonPool:
    return _set_slot(pool, np.array([slot, state], np.int32))


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
    cached and are evicted (least recently used first) only when space is needed."""

    def __init__(self, num_slots: int, vocab_size: int, max_states: int = 4096,
                 max_exceptions: int = 1 << 20) -> None:
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.max_states, self.max_exceptions = max_states, max_exceptions
        self._states = RangeAllocator(max_states)
        self._exc = RangeAllocator(max_exceptions)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # key -> entry, LRU order
        self._req_key: dict[str, str] = {}
        self._dirty_slots: set[int] = set()     # slots whose device state is not -1

    def init_pool(self) -> AutomatonPool:
        return init_pool(self.num_slots, self.vocab_size, self.max_states, self.max_exceptions)

    def attach(self, req_id: str, key: str, tables: AutomatonTables) -> bool:
        if req_id in self._req_key:
            return True
        entry = self._entries.get(key) or self._place(key, tables)
        if entry is None:
            return False
        entry.refs += 1
        self._entries.move_to_end(key)
        self._req_key[req_id] = key
        return True

    def detach(self, req_id: str) -> None:
        key = self._req_key.pop(req_id, None)
        if key is not None:
            self._entries[key].refs -= 1

    def has(self, req_id: str) -> bool:
        return req_id in self._req_key

    def tables_of(self, req_id: str) -> AutomatonTables | None:
        key = self._req_key.get(req_id)
        return None if key is None else self._entries[key].tables

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
        state (initial, or replayed over the outputs it keeps after a preemption)."""
        key = self._req_key.get(req_id)
        if key is None:
            if slot in self._dirty_slots:
                self._dirty_slots.discard(slot)
                pool = set_slot(pool, slot, -1)
            return pool
        e = self._entries[key]
        if not e.uploaded:
            pool = upload(pool, e.tables, e.base, e.xbase)
            e.uploaded = True
        self._dirty_slots.add(slot)
        return set_slot(pool, slot, e.base + e.tables.walk(output_tokens))

    def warmup(self, pool: AutomatonPool, pad_slot: int) -> AutomatonPool:
        """Compile the upload and slot programs (runs them on the pad slot / pad rows)."""
        P, X, W = self.max_states, self.max_exceptions, pool.masks.shape[1]
        z = np.zeros(STATE_CHUNK, np.int32)
        pool = _write_states(pool, np.full(STATE_CHUNK, P, np.int32),
                             np.zeros((STATE_CHUNK, W), np.int32), z, z, z)
        ze = np.zeros(EXC_CHUNK, np.int32)
        pool = _write_exceptions(pool, np.full(EXC_CHUNK, X, np.int32), ze, ze)
        return set_slot(pool, pad_slot, -1)
