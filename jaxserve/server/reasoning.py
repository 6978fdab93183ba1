"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): a reasoning model writes
its thinking between <think> and </think>, then its answer. The thinking is returned
as `message.reasoning_content` (streamed: `delta.reasoning_content`), the answer as
`content`; tool-call parsing and JSON content apply to the answer only.

    deepseek_r1  the chat template opened <think> in the prompt, so the output starts
                 inside the reasoning, which ends at </think> (a <think> the model
                 writes itself at the very start is dropped); no </think>: all of the
                 output is reasoning
    qwen3        reasoning only when the output starts (after whitespace) with <think>;
                 otherwise all of it is content (Qwen3 with enable_thinking=false: its
                 template put an empty <think></think> in the prompt)

A constrained request (response_format, structured_outputs, tool_choice required or a
named function) is constrained in its answer only: constrain_after_reasoning() gives its
constraint the token ids of </think> (structured/reasoning_end.py), so the model thinks
freely first and the grammar starts after </think> (from the first token when the
output cannot start with reasoning: qwen3 with enable_thinking=false).

A parser is fed the output in pieces (one per streamed delta; a whole response is one
piece) and holds back text that may be the start of a tag, so a tag split across
deltas is still found. Whitespace between </think> and the answer is dropped.

Usage counts the reasoning in tokens (reasoning_tokens()): a choice's output tokens up
to and including the first </think> (as end_ids() tokenizes it), all of them when the
output entered the reasoning and never closed it, none when it had no reasoning.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from jaxserve.sampling.params import SamplingParams
from jaxserve.structured.reasoning_end import answer_start
from jaxserve.server.tool_parsers import partial_suffix

START, END = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """The shared state machine: head (maybe a <think>) -> reasoning -> content."""

    name = ""
    starts_inside = False       # output begins inside the reasoning (no <think> needed)

    @classmethod
    def may_reason(cls, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request rendered with these chat-template variables may start its
        output with reasoning (else its constraint holds from the first token)."""
        return True

    def __init__(self) -> None:
        self._state = "head"
        self._buf = ""
        self.entered = False    # some of the output was reasoning (else: no reasoning)

    @property
    def ended(self) -> bool:
        """The reasoning is over (or never was): what comes now is the answer."""
        return self._state in ("after", "content")

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        if self._state == "head":
            head = self._buf.lstrip()
            if not head or (START.startswith(head) and head != START):
                return out                  # may still become <think>
            if head.startswith(START):
                self._buf = head[len(START):]
                self._enter("reasoning")
            elif self.starts_inside:
                self._enter("reasoning")
            else:
                self._state = "content"
        if self._state == "reasoning":
            i = self._buf.find(END)
            if i < 0:
                cut = len(self._buf) - partial_suffix(self._buf, END)
                out.reasoning, self._buf = self._buf[:cut], self._buf[cut:]
                return out
            out.reasoning, self._buf = self._buf[:i], self._buf[i + len(END):]
            self._state = "after"
        if self._state == "after":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._state = "content"
        out.content, self._buf = self._buf, ""
        return out

    def finish(self) -> ReasoningDelta:
        """The output ended: what was held back (a partial tag) is text after all."""
        rest, self._buf = self._buf, ""
        if self._state == "head" and self.starts_inside:
            self._enter("reasoning")
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content="" if self._state == "after" else rest)

    def _enter(self, state: str) -> None:
        self._state, self.entered = state, True


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    @classmethod
    def may_reason(cls, template_kwargs: dict[str, Any] | None) -> bool:
        # enable_thinking=false: the template closed the reasoning in the prompt
        return (template_kwargs or {}).get("enable_thinking", True) is not False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """The whole output at once: (reasoning or None when there was none, content)."""
    a, b = parser.feed(text), parser.finish()
    return (a.reasoning + b.reasoning if parser.entered else None), a.content + b.content


def keep_tags(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """params that keep the tags in the text: a tokenizer that has them as special
    tokens would have skip_special_tokens delete them (and the reasoning never end)."""
    special = getattr(tokenizer, "all_special_tokens", None) or ()
    if params.skip_special_tokens and (START in special or END in special):
        return replace(params, skip_special_tokens=False)
    return params


def constrain_after_reasoning(parser: type[ReasoningParser], params: SamplingParams,
                              tokenizer: Any, template_kwargs: dict[str, Any] | None
                              ) -> SamplingParams:
    """params whose constraint (if any) starts after </think>, tokenized with the served
    tokenizer (one special token for Qwen3 and DeepSeek-R1; a sequence otherwise)."""
    so = params.structured_outputs
    if so is None or not parser.may_reason(template_kwargs):
        return params
    return replace(params, structured_outputs=replace(so, reasoning_end=list(end_ids(tokenizer))))


def end_ids(tokenizer: Any) -> tuple[int, ...]:
    """</think> as the served tokenizer's token ids (one special token for Qwen3 and
    DeepSeek-R1; a sequence otherwise)."""
    return tuple(tokenizer.encode(END, add_special_tokens=False))


def reasoning_tokens(parser: ReasoningParser, output: Sequence[int], end: tuple[int, ...]
                     ) -> int:
    """How many of a choice's output tokens (`output`, read whole by `parser`) are
    reasoning: up to and including the first `end` sequence; all of them when the
    output entered the reasoning and never closed it; 0 without reasoning."""
    if not parser.entered:
        return 0
    i = answer_start(output, end) if end else None
    return len(output) if i is None else i
