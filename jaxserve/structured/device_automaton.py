"""A structured-outputs constraint compiled into a token-level DFA the device can run.

regex, choice and (non-recursive) JSON-schema constraints are regular languages:
outlines-core's Index gives, for each DFA state, the tokens allowed there and the
state each leads to. That becomes fixed-layout arrays (AutomatonTables) that the
device pool (device_pool.py) holds, so masking and state advance happen inside the
jitted step with no host round trip. General grammars (EBNF/Lark, json_object,
recursive schemas) are not regular: they stay on the host path.

Layout (S states, W = ceil(V / 32) words, E exceptions; state 0 is the initial one):

    masks        [S, W] int32   bit j of word w: token 32*w + j allowed in state s
    default_next [S]    int32   where an allowed token goes, unless it is an exception
    exc_start    [S]    int32   state s's exceptions are exc_*[start : start + len],
    exc_len      [S]    int32     sorted by token id (binary search on the device)
    exc_tokens   [E]    int32
    exc_next     [E]    int32
    final        [S]    bool    (host only: EOS bits are set in exactly these states)

A dense next-state table would be S * V * 4 bytes (196 KiB per state for a 49152-token
vocabulary). Most tokens of a state lead to the same place (inside a JSON string,
every token without a quote or backslash loops back), so the state's most common
target is its default and only the others are stored: per state W * 4 bytes of mask
(6 KiB at V = 49152) + 12 bytes + 8 bytes per exception.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import outlines_core

from jaxserve.structured.device_vocab import TokenVocabulary

# JSON between tokens: at most one space (outlines-core's default, any run of blanks,
# lets a sampled model wander off into whitespace until max_tokens)
JSON_WHITESPACE = r"[ ]?"
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


class NotOnDevice(Exception):
    """This constraint cannot (or should not) run on the device: use the host path."""


@dataclass(frozen=True, slots=True)
class AutomatonLimits:
    """Per-constraint bounds; over them the request falls back to the host path."""
    max_states: int = 1024
    max_exceptions: int = 1 << 18


@dataclass(slots=True)
class AutomatonTables:
    """One constraint's DFA (host copy, numpy; see the module docstring)."""
    masks: np.ndarray
    default_next: np.ndarray
    exc_start: np.ndarray
    exc_len: np.ndarray
    exc_tokens: np.ndarray
    exc_next: np.ndarray
    final: np.ndarray
    vocab_size: int

    @property
    def num_states(self) -> int:
        return int(self.masks.shape[0])

    @property
    def num_exceptions(self) -> int:
        return int(self.exc_tokens.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.masks, self.default_next, self.exc_start,
                                           self.exc_len, self.exc_tokens, self.exc_next))

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
        return int(self.default_next[state])

    def walk(self, tokens: list[int], state: int = 0) -> int:
        """The state after `tokens` (the host replay after preemption)."""
        for t in tokens:
            state = self.next_state(state, t)
        return state


# ---- constraint -> regex ------------------------------------------------------------------
def device_regex(so: Any) -> str:
    """The regex of a StructuredOutputsParams, or NotOnDevice (json_object, grammar,
    recursive or unsupported schemas)."""
    if so.regex is not None:
        return so.regex
    if so.choice is not None:
        return "(" + "|".join(_escape(c) for c in so.choice) + ")"
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        if _is_recursive(schema):
            raise NotOnDevice("recursive JSON schema")
        try:
            return outlines_core.json_schema.build_regex_from_schema(
                json.dumps(schema), whitespace_pattern=JSON_WHITESPACE)
        except Exception as e:   # noqa: BLE001 - whatever outlines-core cannot express
            raise NotOnDevice(f"schema not expressible as a regex: {e}") from None
    raise NotOnDevice("json_object and grammar constraints are not regular")


def _escape(text: str) -> str:
    """Literal text in outlines-core's (Rust) regex syntax, which rejects Python's
    re.escape of spaces and other non-meta characters."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _is_recursive(schema: Any) -> bool:
    """Does a local $ref lead back into itself?"""
    def resolve(ref: str) -> Any:
        node: Any = schema
        for part in ref.lstrip("#/").split("/") if ref not in ("#", "#/") else []:
            node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) \
                if isinstance(node, dict) else {}
        return node

    def visit(node: Any, open_refs: tuple[str, ...]) -> bool:
        if isinstance(node, list):
            return any(visit(x, open_refs) for x in node)
        if not isinstance(node, dict):
            return False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref in open_refs:
                return True
            if visit(resolve(ref), open_refs + (ref,)):
                return True
        return any(visit(v, open_refs) for k, v in node.items() if k != "$ref")
    return visit(schema, ())


# ---- regex -> tables -------------------------------------------------------------------------
def compile_tables(regex: str, vocab: TokenVocabulary,
                   limits: AutomatonLimits = AutomatonLimits()) -> AutomatonTables:
    """Build outlines-core's Index for `regex` over `vocab` and lay it out for the
    device. NotOnDevice if the regex does not compile or the tables exceed `limits`."""
    try:
        index = outlines_core.Index(regex, vocab.outlines())
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
    default = np.arange(S, dtype=np.int32)      # a state with no exits stays put
    final = np.array([s in finals for s in order], bool)
    exc_len = np.zeros(S, np.int32)
    exc_tok: list[np.ndarray] = []
    exc_nxt: list[np.ndarray] = []
    eos = np.asarray(vocab.eos_token_ids, np.int64)
    outlines_eos = vocab.eos_token_ids[0]
    for i, s in enumerate(order):
        row = {t: n for t, n in trans.get(s, {}).items() if t != outlines_eos}
        toks = np.fromiter(row.keys(), np.int64, len(row))
        nxt = np.fromiter((local[n] for n in row.values()), np.int32, len(row))
        if final[i]:             # EOS ends the output here; it leaves the state as it is
            toks, nxt = np.concatenate([toks, eos]), np.concatenate(
                [nxt, np.full(len(eos), i, np.int32)])
        if not len(toks):
            continue
        np.bitwise_or.at(masks[i], toks >> 5, (np.uint32(1) << (toks & 31).astype(np.uint32)))
        vals, counts = np.unique(nxt, return_counts=True)
        default[i] = vals[np.argmax(counts)]
        keep = nxt != default[i]
        by_token = np.argsort(toks[keep], kind="stable")
        exc_tok.append(toks[keep][by_token].astype(np.int32))
        exc_nxt.append(nxt[keep][by_token])
        exc_len[i] = int(keep.sum())
    E = int(exc_len.sum())
    if E > limits.max_exceptions:
        raise NotOnDevice(f"{E} transition exceptions > {limits.max_exceptions}")
    exc_start = np.zeros(S, np.int32)
    exc_start[1:] = np.cumsum(exc_len)[:-1]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int32)  # noqa: E731
    return AutomatonTables(masks.view(np.int32), default, exc_start, exc_len,
                           cat(exc_tok).astype(np.int32), cat(exc_nxt).astype(np.int32),
                           final, V)
