"""RequestOutput -> OpenAI JSON pieces: per-choice deltas, logprobs, usage.

The server asks the engine for DELTA outputs when it streams and FINAL_ONLY ones when it
does not, so every RequestOutput it sees holds only new content (a final-only output is
one delta with everything); `ChoiceTracker` keeps the per-choice totals a delta needs
(text offset, tokens so far) and sends each finish reason once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from jaxserve.request import CompletionOutput, Logprob, RequestOutput


class TokenTexts:
    """Text of single tokens for logprobs (cached: the same ids recur a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self.cache) < 100_000:
                self.cache[token_id] = s
        return s


def token_id_text(token_id: int) -> str:
    """A logprob token as vLLM's return_tokens_as_token_ids writes it (a token that is
    not valid text alone, e.g. part of a UTF-8 character, stays identifiable)."""
    return f"token_id:{token_id}"


@dataclass(slots=True)
class Delta:
    index: int                 # choice index in the response
    text: str
    start: int                 # first new token position in output.token_ids
    end: int                   # one past the last new token position in output
    finish_reason: str | None
    stop_reason: int | str | None
    output: CompletionOutput   # this delta's CompletionOutput
    text_offset: int = 0       # characters of this choice's text before this delta
    num_tokens: int = 0        # tokens of this choice so far, this delta's included
    prompt_logprobs: list | None = None   # the prompt's (RequestOutput.prompt_logprobs)


class ChoiceTracker:
    def __init__(self, prompt_index: int, n: int) -> None:
        self.base = prompt_index * n
        self.text_len: dict[int, int] = {}
        self.num_tokens: dict[int, int] = {}
        self.done: set[int] = set()
        self.prompt_logprobs: list | None = None   # a DELTA output brings them once

    def deltas(self, out: RequestOutput) -> list[Delta]:
        """`out` holds new content only (output_kind DELTA or FINAL_ONLY)."""
        res = []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            if c.index in self.done:
                continue
            t0, n0 = self.text_len.get(c.index, 0), self.num_tokens.get(c.index, 0)
            n = n0 + len(c.token_ids)
            self.text_len[c.index], self.num_tokens[c.index] = t0 + len(c.text), n
            if c.finish_reason is not None:
                self.done.add(c.index)
            if c.text or c.token_ids or c.finish_reason is not None:
                res.append(Delta(self.base + c.index, c.text, 0, len(c.token_ids),
                                 c.finish_reason, c.stop_reason, c, t0, n,
                                 self.prompt_logprobs))
        return res


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    items = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
    return [(t, lp.logprob) for t, lp in items[:k]]


def _sampled(entry: dict[int, Logprob], token_id: int) -> float:
    lp = entry.get(token_id)
    return (lp if lp is not None else next(iter(entry.values()))).logprob


def completion_logprobs(texts: Callable[[int], str], c: CompletionOutput, start: int,
                        end: int, k: int, text_offset: int) -> dict[str, Any]:
    """OpenAI legacy completions shape for token positions [start, end)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    entries = c.logprobs or []
    for pos in range(start, min(end, len(entries))):
        tid, entry = c.token_ids[pos], entries[pos]
        s = texts(tid)
        tokens.append(s)
        token_lps.append(_sampled(entry, tid))
        top = {texts(t): lp for t, lp in _ranked(entry, k)}
        top.setdefault(s, token_lps[-1])
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(texts: Callable[[int], str], prompt_ids: list[int], entries: list | None,
                  k: int) -> dict[str, Any]:
    """The legacy completions shape for an echoed prompt: position 0 has no logprob
    (null, as OpenAI and vLLM send), then one per prompt token; offsets from 0."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for pos, tid in enumerate(prompt_ids):
        entry = entries[pos] if entries is not None and pos < len(entries) else None
        s = texts(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp = _finite(_sampled(entry, tid))
        token_lps.append(lp)
        top = {texts(t): _finite(v) for t, v in _ranked(entry, k)}
        top.setdefault(s, lp)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy completions logprobs objects end to end (`then`'s offsets shifted)."""
    ends = first["text_offset"][-1] + len(first["tokens"][-1]) if first["tokens"] else 0
    out = {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs")}
    out["text_offset"] = first["text_offset"] + [ends + o for o in then["text_offset"]]
    return out


def prompt_logprobs_json(texts: TokenTexts, entries: list | None) -> list | None:
    """vLLM's `prompt_logprobs` field: None for position 0, then {token id: {logprob,
    rank, decoded_token}} (JSON object keys are strings; -inf is sent as -9999.0)."""
    if entries is None:
        return None
    return [None if e is None else
            {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                      "decoded_token": texts(t)} for t, lp in e.items()}
            for e in entries]


def _finite(lp: float) -> float:
    return max(lp, -9999.0)     # JSON has no -inf (OpenAI and vLLM send this)


def chat_logprobs(texts: Callable[[int], str], c: CompletionOutput, start: int, end: int,
                  k: int) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    entries = c.logprobs or []
    for pos in range(start, min(end, len(entries))):
        tid, entry = c.token_ids[pos], entries[pos]
        s = texts(tid)
        content.append({
            "token": s, "logprob": _sampled(entry, tid), "bytes": list(s.encode()),
            "top_logprobs": [{"token": texts(t), "logprob": lp, "bytes": list(texts(t).encode())}
                             for t, lp in _ranked(entry, k)]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """cached_tokens None: no prompt_tokens_details (it is a cross-client prefix-cache
    oracle, so the server reports it only with --enable-prompt-tokens-details);
    reasoning_tokens None: no completion_tokens_details (no --reasoning-parser)."""
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u
