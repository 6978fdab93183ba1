"""`--tool-call-parser hermes`: calls written as Hermes / Qwen models write them,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, anywhere in the text; text outside the blocks is content. A block
whose body is not such a JSON object stays content, verbatim. An unclosed block at the
very end is a call if its body parses (the model stopped on EOS before the tag).
"""
from __future__ import annotations

from jaxserve.server.tool_parsers.base import (ParseResult, ToolParser, call_from_json,
                                               partial_suffix)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = START

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""          # text not yet classified
        self._in_call = False   # _buf is the body of an open <tool_call> block

    def feed(self, text: str) -> ParseResult:
        self._buf += text
        res = ParseResult()
        while True:
            if self._in_call:
                j = self._buf.find(END)
                if j < 0:
                    return res
                body, self._buf = self._buf[:j], self._buf[j + len(END):]
                self._in_call = False
                self._block(body, res, closed=True)
            else:
                i = self._buf.find(START)
                if i < 0:       # hold back what may be the start of a tag
                    keep = partial_suffix(self._buf, START)
                    cut = len(self._buf) - keep
                    res.content += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return res
                res.content += self._content(self._buf[:i])
                self._buf, self._in_call = self._buf[i + len(START):], True

    def finish(self) -> ParseResult:
        res = ParseResult()
        if self._in_call:
            self._block(self._buf, res, closed=False)
        else:
            res.content += self._content(self._buf)
        self._buf, self._in_call = "", False
        return res

    def _block(self, body: str, res: ParseResult, closed: bool) -> None:
        call = call_from_json(body.strip(), ("arguments", "parameters"))
        if call is not None:
            res.calls.append(self._call(*call))
        else:
            res.content += self._content(START + body + (END if closed else ""))
