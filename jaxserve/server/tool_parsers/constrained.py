"""Calls whose shape a grammar enforced (tool_choice `required` or a named function).

The request's output is constrained to a JSON schema built here, so these parsers read
JSON, not a model's own call format:

    named function   the output IS the arguments object; one call of that function,
                     its arguments streamed as they are generated
    required         the output is `[{"name": ..., "parameters": {...}}, ...]`, at least
                     one element, each a call of one of the tools with that tool's
                     parameter schema; each call's arguments streamed as they
                     are generated (tool_parsers/streaming.py)
"""
from __future__ import annotations

from typing import Any

from jaxserve.server.tool_parsers.base import (ParseResult, ToolCallDelta, ToolParser,
                                               call_from_json)
from jaxserve.server.tool_parsers.json_scan import JsonDepth
from jaxserve.server.tool_parsers.streaming import CallStreamer

# A function without `parameters` takes none (OpenAI).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or NO_PARAMETERS


def required_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """A non-empty array of calls, each {"name": one tool's name, "parameters": that
    tool's schema}."""
    def one(f: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"name": {"type": "string", "enum": [f["name"]]},
                               "parameters": parameters_schema(f)},
                "required": ["name", "parameters"], "additionalProperties": False}
    return {"type": "array", "minItems": 1,
            "items": {"type": "object", "anyOf": [one(f) for f in functions]}}


class NamedFunctionParser(ToolParser):
    """All output text is the arguments of one call of `function_name`."""

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def feed(self, text: str) -> ParseResult:
        if self.num_calls == 0:
            text = text.lstrip()
            if not text:
                return ParseResult()
            return ParseResult(calls=[self._call(self.function_name, text)])
        return ParseResult(calls=[ToolCallDelta(0, text)]) if text else ParseResult()

    def finish(self) -> ParseResult:
        return ParseResult()


class RequiredCallsParser(ToolParser):
    """Reads `[{"name": ..., "parameters": {...}}, ...]`; each element's parameters are
    streamed as they come (read whole when it closes, if in another key order). Text
    that breaks the shape (only possible when the output was cut short by max_tokens)
    ends parsing; a reply with no call at all is content."""

    def __init__(self) -> None:
        super().__init__()
        self._scan = JsonDepth()
        self._item = ""         # the element being read
        self._text = ""         # all text (content, should no call come out of it)
        self._broken = False
        self._call_text = CallStreamer()    # the element being read, streamed

    def feed(self, text: str) -> ParseResult:
        res = ParseResult()
        self._text += text
        for ch in text:
            if self._broken:
                break
            self._step(ch, res)
        return res

    def _step(self, ch: str, res: ParseResult) -> None:
        before = self._scan.depth
        self._scan.step(ch)
        if before == 0 and self._scan.depth == 0 and not ch.isspace():
            self._broken = True         # something other than the array
        elif self._item or (before == 1 and ch == "{"):
            if not self._item:
                self._call_text = CallStreamer()
            self._item += ch
            self._streamed(self._call_text, ch, res)
            if self._scan.depth == 1 and not self._scan.in_string:
                if not self._call_text.started:     # another key order: read it whole
                    call = call_from_json(self._item, ("parameters",))
                    if call is None:
                        self._broken = True
                    else:
                        res.calls.append(self._call(*call))
                self._item = ""

    def finish(self) -> ParseResult:
        if self.num_calls == 0:
            return ParseResult(content=self._text.strip())
        return ParseResult()

