"""`--tool-call-parser hermes`: calls written as Hermes / Qwen models write them,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, anywhere in the text; text outside the blocks is content. A call's
arguments are streamed as they are generated (tool_parsers/streaming.py). A block
whose body is not a call at all stays content, verbatim. An unclosed block at the
very end is a call if it started like one (the model stopped on EOS before the tag).
"""
from __future__ import annotations

from jaxserve.server.tool_parsers.base import (ParseResult, ToolParser, call_from_json,
                                               partial_suffix)
from jaxserve.server.tool_parsers.streaming import CallStreamer

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = START

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""                          # text not yet classified
        self._open: CallStreamer | None = None  # the open <tool_call> block's body

    def feed(self, text: str) -> ParseResult:
        self._buf += text
        res = ParseResult()
        while True:
            if self._open is not None:
                j = self._buf.find(END)
                if j < 0:       # pass on what cannot be the start of the end tag
                    cut = len(self._buf) - partial_suffix(self._buf, END)
                    self._streamed(self._open, self._buf[:cut], res)
                    self._buf = self._buf[cut:]
                    return res
                self._streamed(self._open, self._buf[:j], res)
                self._buf = self._buf[j + len(END):]
                self._close(res, closed=True)
            else:
                i = self._buf.find(START)
                if i < 0:       # hold back what may be the start of a tag
                    keep = partial_suffix(self._buf, START)
                    cut = len(self._buf) - keep
                    res.content += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return res
                res.content += self._content(self._buf[:i])
                self._buf, self._open = self._buf[i + len(START):], CallStreamer()

    def finish(self) -> ParseResult:
        res = ParseResult()
        if self._open is not None:
            self._streamed(self._open, self._buf, res)
            self._close(res, closed=False)
        else:
            res.content += self._content(self._buf)
        self._buf = ""
        return res

    def _close(self, res: ParseResult, closed: bool) -> None:
        """The block ended: a call not streamed (another shape) is read whole now."""
        call, self._open = self._open, None
        assert call is not None
        if call.started:
            return
        body = call.text
        parsed = call_from_json(body.strip(), ("arguments", "parameters"))
        if parsed is not None:
            res.calls.append(self._call(*parsed))
        else:
            res.content += self._content(START + body + (END if closed else ""))
