"""A structured-outputs constraint compiled into a token-level DFA the device can run.

regex, choice and (non-recursive) JSON-schema constraints are regular languages:
outlines-core's Index gives, for each DFA state, the tokens allowed there and the
state each leads to. That becomes fixed-layout arrays (AutomatonTables) that the
device pool (device_pool.py) holds, so masking and state advance happen inside the
jitted step with no host round trip. General grammars (EBNF/Lark, json_object,
recursive schemas) are not regular: they stay on the host path.

Layout (S states, W = ceil(V / 32) words; state 0 is the initial one):

    masks      [S, W]   int32  bit j of word w: token 32*w + j allowed in state s
                               (EOS exactly in the final states)
    byte_next  [S, 256] int32  the state after one byte (a byte the state does not
                               allow leaves it where it is: never sampled)
    exc_start  [S]      int32  the (state, token) pairs whose byte walk is not the
    exc_len    [S]      int32    Index's transition: state s's run exc_*[start :
    exc_tokens [E]      int32    start + len], sorted by token (binary search)
    exc_next   [E]      int32
    final      [S]      bool   (host only)

A token's next state is the walk of its bytes through byte_next (the vocabulary's
token bytes, [V, L] uint8, are shared by every constraint): outlines-core's DFA is a
byte-level DFA, and the byte-level tokenizer has a token for almost every byte, so
byte_next comes from the single-byte tokens' transitions. The compile walks every
allowed token's bytes and keeps the pairs where that is not the Index's next state as
exceptions (a multi-byte character whose lone lead byte the Index does not allow:
14 pairs for Unicode digits, one or more; too many -> host path). A dense next-state table would be S * V * 4
bytes (196 KiB per state at V = 49152) and a per-state list of the tokens that do not
follow the state's most common transition blows up on counted repeats ([a-z]{0,24}:
each token length lands elsewhere); the byte walk costs (W + 258) * 4 bytes per
state, 7 KiB at V = 49152, plus 8 bytes per exception.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.structured.device_vocab import TokenVocabulary

MAX_TOKEN_BYTES = 128     # longest token the device walks (the pool's token-bytes width)
# JSON between tokens: at most one space (outlines-core's default, any run of blanks,
# lets a sampled model wander off into whitespace until max_tokens)
JSON_WHITESPACE = r"[ ]?"
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


class NotOnDevice(Exception):
    """This constraint cannot (or should not) run on the device: use the host path."""


def _outlines() -> Any:
    """outlines-core, imported on first use: without it the host path takes everything."""
    try:
        import outlines_core
    except ImportError:
        raise NotOnDevice("outlines-core is not installed") from None
    return outlines_core


@dataclass(frozen=True, slots=True)
class AutomatonLimits:
    """Per-constraint bounds; over them the request falls back to the host path."""
    max_states: int = 1024
    max_token_bytes: int = MAX_TOKEN_BYTES
    max_exceptions: int = 4096


@dataclass(slots=True)
class AutomatonTables:
    """One constraint's DFA (host copy, numpy; see the module docstring)."""
    masks: np.ndarray
    byte_next: np.ndarray
    exc_start: np.ndarray
    exc_len: np.ndarray
    exc_tokens: np.ndarray
    exc_next: np.ndarray
    final: np.ndarray
    token_bytes: np.ndarray           # [V, L] uint8: the vocabulary's (shared, not a copy)
    token_len: np.ndarray             # [V] int32
    max_token_len: int                # the longest token any state allows

    @property
    def num_states(self) -> int:
        return int(self.masks.shape[0])

    @property
    def num_exceptions(self) -> int:
        return int(self.exc_tokens.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.token_len.shape[0])

    @property
    def nbytes(self) -> int:
        """Device bytes of this constraint (the shared token bytes not counted)."""
        return int(self.masks.nbytes + self.byte_next.nbytes + 8 * self.num_states
                   + 8 * self.num_exceptions)

    def allowed(self, state: int) -> np.ndarray:
        """Sorted token ids allowed in `state`."""
        bits = (self.masks[state].view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        return np.nonzero(bits.reshape(-1)[:self.vocab_size])[0]

    def next_state(self, state: int, token: int) -> int:
        a = int(self.exc_start[state])
        b = a + int(self.exc_len[state])
        i = a + int(np.searchsorted(self.exc_tokens[a:b], token))
        if i < b and self.exc_tokens[i] == token:
            return int(self.exc_next[i])
        for byte in self.token_bytes[token, :self.token_len[token]]:
            state = int(self.byte_next[state, byte])
        return state

    def walk(self, tokens: list[int], state: int = 0) -> int:
        """The state after `tokens` (the host replay after preemption)."""
        for t in tokens:
            state = self.next_state(state, t)
        return state


# ---- constraint -> regex ------------------------------------------------------------------
# A schema whose $refs, inlined, would exceed this many nodes is not tried on the device
# (outlines-core inlines every reference: a chain of n definitions that each use the
# next twice is 2^n nodes)
MAX_SCHEMA_EXPANSION = 20_000


def constraint_source(so: Any) -> tuple[str, str]:
    """(kind, text) of a regular constraint, without analysing it (cheap: the engine
    thread calls this); NotOnDevice for json_object and grammars."""
    if so.regex is not None:
        return "regex", so.regex
    if so.choice is not None:
        return "choice", json.dumps(so.choice)
    if so.json is not None:
        if isinstance(so.json, str):
            return "json", so.json
        try:
            return "json", json.dumps(so.json)
        except (TypeError, ValueError, RecursionError) as e:
            raise NotOnDevice(f"schema is not JSON: {type(e).__name__}") from None
    raise NotOnDevice("json_object and grammar constraints are not regular")


def device_regex(so: Any) -> str:
    """The regex of a StructuredOutputsParams, or NotOnDevice (json_object, grammar,
    recursive or unsupported schemas)."""
    return regex_of(*constraint_source(so))


def regex_of(kind: str, text: str) -> str:
    """The regex of a constraint_source(); the analysis is linear in the schema."""
    if kind == "regex":
        return text
    if kind == "choice":
        return "(" + "|".join(_escape(c) for c in json.loads(text)) + ")"
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:      # the host path reports it to the user
        raise NotOnDevice(f"schema is not JSON: {e}") from None
    graph = _SchemaGraph(schema)
    if graph.has_cycle():
        raise NotOnDevice("recursive JSON schema")
    size = graph.expanded_size(MAX_SCHEMA_EXPANSION)
    if size >= MAX_SCHEMA_EXPANSION:
        raise NotOnDevice(f"the schema's references expand to more than "
                          f"{MAX_SCHEMA_EXPANSION} nodes")
    try:
        return _outlines().json_schema.build_regex_from_schema(
            json.dumps(schema), whitespace_pattern=JSON_WHITESPACE)
    except Exception as e:   # noqa: BLE001 - whatever outlines-core cannot express
        raise NotOnDevice(f"schema not expressible as a regex: {e}") from None


def _escape(text: str) -> str:
    """Literal text in outlines-core's (Rust) regex syntax, which rejects Python's
    re.escape of spaces and other non-meta characters."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class _SchemaGraph:
    """A schema's containers (dicts and lists) as a graph: edges to their children and
    from each local $ref to the node it names. A cycle is a reference that leads back
    into itself. Built and walked iteratively, each node once: linear in the schema,
    whatever its depth or its reference structure."""

    def __init__(self, schema: Any) -> None:
        self.root = schema
        self.nodes: dict[int, Any] = {}
        self.edges: dict[int, list[int]] = {}
        stack = [schema]
        while stack:
            node = stack.pop()
            if id(node) in self.nodes or not isinstance(node, (dict, list)):
                continue
            self.nodes[id(node)] = node
            kids = [v for k, v in node.items() if k != "$ref"] if isinstance(node, dict) \
                else list(node)
            kids = [k for k in kids if isinstance(k, (dict, list))]
            ref = node.get("$ref") if isinstance(node, dict) else None
            if isinstance(ref, str) and ref.startswith("#"):
                target = self._resolve(ref)
                if isinstance(target, (dict, list)):
                    kids.append(target)
            self.edges[id(node)] = [id(k) for k in kids]
            stack.extend(kids)

    def _resolve(self, ref: str) -> Any:
        node: Any = self.root
        for part in ref.lstrip("#/").split("/") if ref not in ("#", "#/") else []:
            node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) \
                if isinstance(node, dict) else {}
        return node

    def has_cycle(self) -> bool:
        state: dict[int, int] = {}          # 1 on the DFS path, 2 done
        for start in self.nodes:
            if start in state:
                continue
            state[start] = 1
            stack = [(start, iter(self.edges[start]))]
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[node] = 2
                    stack.pop()
                elif state.get(nxt) == 1:
                    return True
                elif nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, iter(self.edges[nxt])))
        return False

    def expanded_size(self, cap: int) -> int:
        """Nodes of the schema with every reference inlined, counted up to `cap` (call
        only on an acyclic graph)."""
        size: dict[int, int] = {}
        stack = [(id(self.root), False)] if id(self.root) in self.nodes else []
        while stack:
            node, expanded = stack.pop()
            if node in size:
                continue
            if not expanded:
                stack.append((node, True))
                stack.extend((k, False) for k in self.edges[node] if k not in size)
            else:
                size[node] = min(cap, 1 + sum(size[k] for k in self.edges[node]))
        return size.get(id(self.root), 1)


# ---- regex -> tables -------------------------------------------------------------------------
def compile_tables(regex: str, vocab: TokenVocabulary,
                   limits: AutomatonLimits = AutomatonLimits()) -> AutomatonTables:
    """Build outlines-core's Index for `regex` over `vocab` and lay it out for the
    device. NotOnDevice if the regex does not compile or the tables exceed `limits`."""
    try:
        index = _outlines().Index(regex, vocab.outlines())
    except Exception as e:       # noqa: BLE001 - the host path reports the real error
        raise NotOnDevice(f"outlines-core could not index the regex: {e}") from None
    return tables_from_index(index, vocab, limits)


def tables_from_index(index: Any, vocab: TokenVocabulary,
                      limits: AutomatonLimits = AutomatonLimits()) -> AutomatonTables:
    trans: dict[int, dict[int, int]] = index.get_transitions()
    init = index.get_initial_state()
    finals = set(index.get_final_states())
    order = sorted(set(trans) | finals | {init}, key=lambda s: (s != init, s))
    if len(order) > limits.max_states:
        raise NotOnDevice(f"{len(order)} DFA states > {limits.max_states}")
    local = {s: i for i, s in enumerate(order)}
    S, V = len(order), vocab.vocab_size
    masks = np.zeros((S, -(-V // 32)), np.uint32)
    byte_next = np.repeat(np.arange(S, dtype=np.int32)[:, None], 256, axis=1)
    final = np.array([s in finals for s in order], bool)
    eos = np.asarray(vocab.eos_token_ids, np.int64)
    singles = vocab.byte_tokens()
    src, toks_all, dst = [], [], []
    for i, s in enumerate(order):
        row = {t: local[n] for t, n in trans.get(s, {}).items() if t != eos[0]}
        toks = np.fromiter(row.keys(), np.int64, len(row))
        src.append(np.full(len(row), i, np.int32))
        toks_all.append(toks)
        dst.append(np.fromiter(row.values(), np.int32, len(row)))
        for b, t in singles.items():
            if t in row:
                byte_next[i, b] = row[t]
        if final[i]:             # EOS ends the output here (its walk is empty: stays)
            toks = np.concatenate([toks, eos])
        if len(toks):
            np.bitwise_or.at(masks[i], toks >> 5,
                             np.uint32(1) << (toks & 31).astype(np.uint32))
    tb, tl = vocab.byte_arrays()
    src_a, tok_a, dst_a = (np.concatenate(x) if x else np.zeros(0, np.int64)
                           for x in (src, toks_all, dst))
    longest = int(tl[tok_a].max()) if len(tok_a) else 0
    if longest > limits.max_token_bytes:
        raise NotOnDevice(f"an allowed token of {longest} bytes > {limits.max_token_bytes}")
    wrong = walk_bytes(byte_next, tb, tl, src_a, tok_a) != dst_a
    if int(wrong.sum()) > limits.max_exceptions:
        raise NotOnDevice(f"{int(wrong.sum())} token transitions are not byte walks "
                          f"> {limits.max_exceptions}")
    order_e = np.lexsort((tok_a[wrong], src_a[wrong]))          # by state, then token
    e_src, e_tok, e_dst = src_a[wrong][order_e], tok_a[wrong][order_e], dst_a[wrong][order_e]
    exc_len = np.bincount(e_src, minlength=S).astype(np.int32)
    exc_start = (np.cumsum(exc_len) - exc_len).astype(np.int32)
    return AutomatonTables(masks.view(np.int32), byte_next, exc_start, exc_len,
                           e_tok.astype(np.int32), e_dst.astype(np.int32), final, tb, tl,
                           longest)


def walk_bytes(byte_next: np.ndarray, token_bytes: np.ndarray, token_len: np.ndarray,
               states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Vectorized: the state each (state, token) pair's byte walk ends in."""
    n = token_len[tokens]
    by_len = np.argsort(-n, kind="stable")
    s, t, n = states[by_len].astype(np.int32), tokens[by_len], n[by_len]
    for i in range(int(n.max()) if len(n) else 0):
        live = int(np.count_nonzero(n > i))          # a prefix: sorted longest first
        s[:live] = byte_next[s[:live], token_bytes[t[:live], i]]
    out = np.empty_like(s)
    out[by_len] = s
    return out
