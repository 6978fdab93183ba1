"""A chat choice's generated text -> the assistant message (or streamed delta).

The text goes through up to two readers, in this order, one of each per choice:

    reasoning parser   (--reasoning-parser) <think>...</think> -> reasoning_content;
                       the rest is the answer
    tool-call parser   (tools with tool_choice auto / required / named) the answer ->
                       content and tool_calls

then `echo` puts the last message's content (when it is the assistant's, as vLLM
does) in front of the content. Streaming and whole responses share the readers, so
both say the same thing.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxserve.server.formatting import Delta
from jaxserve.server.reasoning import ReasoningParser, reasoning_tokens, split_reasoning
from jaxserve.server.tool_calling import ToolCallOutputs


@dataclass(slots=True)
class ChatOutputs:
    calls: ToolCallOutputs | None = None
    reasoning: type[ReasoningParser] | None = None
    echo: str = ""                  # text the reply starts with
    end: tuple[int, ...] = ()       # </think>'s token ids (reasoning_tokens)
    _thinkers: dict[int, ReasoningParser] = field(default_factory=dict)

    def message(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        """A whole choice: (message, finish_reason)."""
        reasoning, answer = None, d.text
        if self.reasoning is not None:
            p = self._thinkers[d.index] = self.reasoning()
            reasoning, answer = split_reasoning(p, d.text)
        reason = d.finish_reason
        if self.calls is not None:
            msg, reason = self.calls.message(d.index, answer, reason)
        else:
            msg = {"role": "assistant", "content": answer}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
            if not msg["content"] and not self.echo:
                msg["content"] = None       # all reasoning, no answer (vLLM's null)
        if self.echo:
            msg["content"] = self.echo + (msg["content"] or "")
        return msg, reason

    def delta(self, d: Delta, first: bool) -> tuple[dict[str, Any], str | None]:
        """A streamed piece: (delta, finish_reason); the delta may be empty (a reader
        holds back text that may be a tag)."""
        final = d.finish_reason is not None
        reasoning, answer = self._split(d.index, d.text, final)
        out: dict[str, Any] = {"role": "assistant"} if first else {}
        if reasoning:
            out["reasoning_content"] = reasoning
        reason = d.finish_reason
        if self.calls is not None:
            piece, reason = self.calls.delta(d.index, answer, reason)
            out.update(piece)
        elif answer:
            out["content"] = answer
        if first and (self.echo or not (reasoning or out.get("tool_calls"))):
            out["content"] = self.echo + out.get("content", "")
        return out, reason

    def _split(self, index: int, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        p = self._thinkers.get(index)
        if p is None:
            p = self._thinkers[index] = self.reasoning()
        a = p.feed(text)
        if not final:
            return a.reasoning, a.content
        b = p.finish()
        return a.reasoning + b.reasoning, a.content + b.content

    def reasoning_tokens(self, index: int, output: Sequence[int]) -> int:
        """How many of choice `index`'s output tokens (all of them; its text was read
        to the end) are reasoning."""
        p = self._thinkers.get(index)
        return 0 if p is None else reasoning_tokens(p, output, self.end)
