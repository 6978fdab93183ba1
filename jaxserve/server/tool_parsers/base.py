"""What every tool-call parser shares: the delta it returns, content hygiene, ids.

A parser turns the model's generated text into content and tool calls, fed in pieces
(one piece per streamed delta; a non-streamed response is one piece) and told when the
text ends. Streaming and non-streaming share the parser, so both see the same calls:

    p = HermesToolParser()
    for piece in pieces:  r = p.feed(piece)    # r.content: text safe to show now
    r = p.finish()                              # r.calls: calls completed by this piece

A parser holds back text that may still turn out to be part of a call (a partial
`<tool_call>` tag, an unclosed call), and drops whitespace that only separates calls
from each other or from the ends of the text (so content is None for a reply that is
only calls, as OpenAI's is).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from jaxserve.server.tool_parsers.streaming import CallStreamer


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of the call number `index` (0, 1, ... per choice). The first piece of a
    call carries its id and name; later pieces (if any) only more argument text."""
    index: int
    arguments: str
    name: str | None = None
    id: str | None = None

    def openai(self) -> dict[str, Any]:
        """The OpenAI streaming shape (`delta.tool_calls[i]`)."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParseResult:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (text that
    may become the tag once more arrives)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def call_from_json(text: str, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) from `{"name": ..., <arg key>: {...}}`, or None
    when `text` is not such an object (then it stays content). A missing argument key
    means no arguments."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):       # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolParser:
    """Base: call numbering and the whitespace rules. Subclasses implement feed/finish."""

    name: str = ""
    # The text that opens a call; the server keeps it in the output when the tokenizer
    # has it as a special token (else skip_special_tokens would delete it).
    start_tag: str = ""

    def __init__(self) -> None:
        self.num_calls = 0
        self._ws = ""              # trailing whitespace held until more content comes
        self._at_edge = True       # at the start, or right after a call: drop whitespace

    def feed(self, text: str) -> ParseResult:
        raise NotImplementedError

    def finish(self) -> ParseResult:
        raise NotImplementedError

    # ---- for subclasses -------------------------------------------------------------
    def _content(self, text: str) -> str:
        """Content to show now: whitespace touching a call or an end is held back, and
        dropped if a call or the end follows it."""
        if self._at_edge:
            text = text.lstrip()
            if not text:
                return ""
            self._at_edge = False
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept):]
        return kept

    def _call(self, name: str, arguments: str) -> ToolCallDelta:
        """A new whole call; whitespace around it is not content."""
        self._ws, self._at_edge = "", True
        d = ToolCallDelta(self.num_calls, arguments, name, new_call_id())
        self.num_calls += 1
        return d

    def _streamed(self, call: CallStreamer, text: str, res: ParseResult) -> None:
        """Feed `text` of a call to its streamer: OpenAI's first delta (id, name,
        arguments "") once the call is known, then its argument text as it comes
        (joined with the piece before when both are argument text)."""
        was = call.started
        arguments = call.feed(text)
        if call.started and not was:
            assert call.name is not None
            res.calls.append(self._call(call.name, ""))
        if arguments:
            last = res.calls[-1] if res.calls else None
            if last is not None and last.name is None and last.index == self.num_calls - 1:
                last.arguments += arguments
            else:
                res.calls.append(ToolCallDelta(self.num_calls - 1, arguments))

    # ---- for the prompt (templates that do not render tools, docs/serving.md) -------
    @staticmethod
    def render_call(name: str, arguments: dict[str, Any]) -> str:
        """A past call as this format writes it (conversation history)."""
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"

    @staticmethod
    def call_format() -> str:
        """How to write a call, for the fallback system prompt."""
        return ("For each function call, write a JSON object with the function's name "
                "and its arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <arguments-json-object>}\n'
                "</tool_call>")


def parse_all(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCallDelta]]:
    """The whole text at once (a non-streamed response): (content or None, calls)."""
    a, b = parser.feed(text), parser.finish()
    content = a.content + b.content
    return (content or None), merge_calls(a.calls + b.calls)


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Join the pieces of each call (first piece: id and name; the rest: arguments)."""
    calls: dict[int, ToolCallDelta] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCallDelta(d.index, d.arguments, d.name, d.id)
        else:
            calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]
