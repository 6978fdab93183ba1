"""One call's JSON text read as it is generated, so its arguments can be streamed.

OpenAI streams a call as a first delta with its id, type and name (arguments "") and
then the arguments text in fragments as the model writes them. A parser feeds the
call's JSON here piece by piece: once `{"name": "f", "arguments": {` (or
"parameters") has arrived the call is known, and from then on every character of the
arguments object is passed on as it comes; text after the object's end is not.

The arguments are the model's own text: a call whose arguments turn out malformed
(cut short by max_tokens, or a model's mistake) still is a call, its arguments not
valid JSON, as OpenAI warns its models' may be. A call in another shape (arguments as
a JSON string, keys in another order) is not streamed: the parser reads it whole when
it ends.
"""
from __future__ import annotations

import re

from jaxserve.server.tool_parsers.json_scan import JsonDepth

HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*'
                    r'"(?:arguments|parameters)"\s*:\s*(?=\{)')
HEADER_MAX = 256        # characters: a header not found by then is not coming


class CallStreamer:
    def __init__(self) -> None:
        self.text = ""                  # all text fed (the whole call, for a late read)
        self.name: str | None = None    # known once the header has arrived
        self._scan = JsonDepth()
        self._closed = False            # the arguments object has ended
        self._searching = True

    @property
    def started(self) -> bool:
        return self.name is not None

    def feed(self, text: str) -> str:
        """-> the arguments text new in `text` ("" before the call is known)."""
        self.text += text
        if self.name is not None:
            return self._arguments(text)
        if not self._searching:
            return ""
        m = HEADER.match(self.text)
        if m is None:
            self._searching = len(self.text) < HEADER_MAX
            return ""
        self.name = m.group(1)
        return self._arguments(self.text[m.end():])

    def _arguments(self, text: str) -> str:
        out = []
        for ch in text:
            if self._closed:
                break
            self._scan.step(ch)
            out.append(ch)
            self._closed = self._scan.outside
        return "".join(out)
