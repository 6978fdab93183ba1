"""Tool-call parsers: generated text -> content + OpenAI tool calls (docs/serving.md).

`--tool-call-parser NAME` picks the format that `tool_choice: auto` reads (vLLM's
names); `required` and named choices use the constrained parsers, whatever the flag.
"""
from __future__ import annotations

from jaxserve.server.tool_parsers.base import (ParseResult, ToolCallDelta, ToolParser,
                                               merge_calls, parse_all, partial_suffix)
from jaxserve.server.tool_parsers.constrained import (NamedFunctionParser,
                                                      RequiredCallsParser, parameters_schema,
                                                      required_schema)
from jaxserve.server.tool_parsers.hermes import HermesToolParser
from jaxserve.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "ParseResult", "ToolCallDelta", "ToolParser", "merge_calls",
           "parse_all", "partial_suffix", "NamedFunctionParser", "RequiredCallsParser",
           "parameters_schema", "required_schema", "HermesToolParser",
           "Llama3JsonToolParser"]
