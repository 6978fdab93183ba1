"""`--tool-call-parser llama3_json`: calls as Llama 3.1+ models write them with JSON tool
calling: the whole reply is the call(s), optionally after `<|python_tag|>`,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several separated by `;`, each call's arguments streamed as they are generated
(tool_parsers/streaming.py). A reply that does not start with `{` (or the tag) is
plain content; so is everything from the first object that is not a call (or the
first text that is not a call or a separator) to the end.
"""
from __future__ import annotations

import json
from typing import Any

from jaxserve.server.tool_parsers.base import ParseResult, ToolParser, call_from_json
from jaxserve.server.tool_parsers.json_scan import JsonDepth
from jaxserve.server.tool_parsers.streaming import CallStreamer

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_tag = TAG

    def __init__(self) -> None:
        super().__init__()
        self._mode = "undecided"    # -> "calls" or "content" (then for good)
        self._buf = ""              # undecided: the head; calls: the current object
        self._scan = JsonDepth()
        self._call_text = CallStreamer()    # the current object, streamed

    def feed(self, text: str) -> ParseResult:
        res = ParseResult()
        if self._mode == "undecided":
            self._buf += text
            head = self._buf.lstrip()
            if not head or (TAG.startswith(head) and head != TAG):
                return res              # still may be the tag: hold it back
            text, self._buf = self._buf, ""
            if head.startswith(TAG):
                self._mode, text = "calls", head[len(TAG):]
            else:
                self._mode = "calls" if head.startswith("{") else "content"
        if self._mode == "content":
            res.content += self._content(text)
            return res
        self._scan_calls(text, res)
        return res

    def _scan_calls(self, text: str, res: ParseResult) -> None:
        for i, ch in enumerate(text):
            if self._scan.outside and not self._buf:
                if ch.isspace() or ch == ";":
                    continue
                if ch != "{":               # not a call: the rest is content
                    self._to_content(text[i:], res)
                    return
                self._call_text = CallStreamer()
            self._buf += ch
            self._scan.step(ch)
            self._streamed(self._call_text, ch, res)
            if self._scan.outside:          # an object just closed
                if not self._call_text.started:     # another shape: read it whole
                    call = call_from_json(self._buf, ("parameters", "arguments"))
                    if call is None:
                        self._to_content(text[i + 1:], res)
                        return
                    res.calls.append(self._call(*call))
                self._buf = ""

    def _to_content(self, rest: str, res: ParseResult) -> None:
        self._mode = "content"
        res.content += self._content(self._buf + rest)
        self._buf = ""

    def finish(self) -> ParseResult:
        res = ParseResult()
        if self._buf and self._mode == "calls" and self._call_text.started:
            self._buf = ""  # a call cut short: it stays a call (its arguments unfinished)
        if self._buf:       # an unfinished object or an undecided head: content
            res.content += self._content(self._buf)
            self._buf = ""
        return res

    @staticmethod
    def render_call(name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    @staticmethod
    def call_format() -> str:
        return ("To call a function, reply with only a JSON object giving the function's "
                "name and its parameters (several calls: separate the objects with ';'):\n"
                '{"name": <function-name>, "parameters": <arguments-json-object>}')
