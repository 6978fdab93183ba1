"""Tool calling on /v1/chat/completions: what a request's tool_choice asks of the engine
and how its output becomes OpenAI tool calls (docs/serving.md, "Tool calling").

    none      tools are not rendered, output is content (as vLLM with
              --exclude-tools-when-tool-choice-none)
    auto      tools rendered; the output is read by the --tool-call-parser
              (needs --enable-auto-tool-choice, else 400, as in vLLM)
    required  output constrained (structured outputs, JSON schema) to a non-empty
              array of calls of the given tools
    named     output constrained to that function's parameter schema; it is the
              arguments of one call (finish_reason stays "stop", as OpenAI's)

finish_reason is "tool_calls" when auto or required produced calls and generation
stopped by itself (not at max_tokens).
"""
from __future__ import annotations

import json

from dataclasses import dataclass, field, replace
from typing import Any

from jaxserve.sampling.params import (SamplingParams, SamplingParamsError,
                                      StructuredOutputsParams)
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from jaxserve.server.tool_parsers import (TOOL_PARSERS, HermesToolParser, NamedFunctionParser,
                                          ParseResult, RequiredCallsParser, ToolParser,
                                          merge_calls, parameters_schema, required_schema)

_AUTO_OFF = ('tool_choice "auto" is not supported by this server: it needs '
             "--enable-auto-tool-choice and --tool-call-parser (tool_choice is \"auto\" "
             'by default when tools are given); use "required", "none" or a named function')


@dataclass(slots=True)
class ToolPlan:
    choice: str                      # "auto" | "required" | "named"
    tools: list[dict[str, Any]]      # OpenAI tool objects, for the template
    style: type[ToolParser]          # the call format (auto's parser; fallback prompt)
    function: str | None = None      # named: the function
    parallel: bool = True            # parallel_tool_calls (false: one call at most)

    def new_parser(self) -> ToolParser:
        if self.choice == "named":
            assert self.function is not None
            return NamedFunctionParser(self.function)
        return RequiredCallsParser() if self.choice == "required" else self.style()

    def constraint(self) -> StructuredOutputsParams | None:
        fns = [t["function"] for t in self.tools]
        if self.choice == "named":
            f = next(f for f in fns if f["name"] == self.function)
            return StructuredOutputsParams(json=parameters_schema(f))
        if self.choice == "required":
            schema = required_schema(fns)
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def adjust(self, params: SamplingParams, tokenizer: Any) -> SamplingParams:
        """The request's sampling params with the constraint this choice needs."""
        so = self.constraint()
        if so is not None:
            if params.structured_outputs is not None:
                raise APIError(400, "tool_choice 'required' or a named function constrains "
                                    "the output itself; it cannot be combined with "
                                    "response_format / structured_outputs",
                               param="tool_choice")
            return replace(params, structured_outputs=so)
        # a call tag that is a special token would be deleted from the text otherwise
        if self.style.start_tag in (getattr(tokenizer, "all_special_tokens", None) or ()):
            return replace(params, skip_special_tokens=False)
        return params


def plan_tools(req: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan | None:
    """None when nothing is to be called (tool_choice none, or no tools). Raises
    APIError 400 for auto on a server without --enable-auto-tool-choice."""
    choice = req.effective_tool_choice
    tools = template_tools(req)
    if choice == "none" or not tools:
        return None
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", tools, call_style(auto_parser), choice.function.name,
                        parallel)
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, _AUTO_OFF, param="tool_choice")
        return ToolPlan("auto", tools, TOOL_PARSERS[auto_parser], None, parallel)
    return ToolPlan("required", tools, call_style(auto_parser), None, parallel)


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as OpenAI tool objects, for the chat template."""
    return [{"type": "function", "function": {
        k: v for k in ("name", "description", "parameters")
        if (v := getattr(t.function, k)) is not None}} for t in req.tools or ()] or None


def schema_error(e: SamplingParamsError) -> Exception:
    """A constraint built from the tools that the grammar check refused: the fault is in
    a tool's parameters schema, so the 400 names tools."""
    if e.param != "structured_outputs":
        return e
    why = str(e).split(": ", 1)[-1]
    return APIError(400, f"tools: a function's parameters schema cannot constrain the "
                         f"output ({why})", param="tools")


def call_style(auto_parser: str | None) -> type[ToolParser]:
    """The call format past calls are written in when the template takes no tools."""
    return TOOL_PARSERS[auto_parser] if auto_parser else HermesToolParser


@dataclass(slots=True)
class ToolCallOutputs:
    """One response's choices read through the plan's parser (one parser per choice)."""
    plan: ToolPlan
    parsers: dict[int, ToolParser] = field(default_factory=dict)
    called: set[int] = field(default_factory=set)

    def read(self, index: int, text: str, final: bool) -> ParseResult:
        p = self.parsers.get(index)
        if p is None:
            p = self.parsers[index] = self.plan.new_parser()
        r = p.feed(text)
        if final:
            end = p.finish()
            r = ParseResult(r.content + end.content, r.calls + end.calls)
        if not self.plan.parallel:
            r.calls = [c for c in r.calls if c.index == 0]
        if r.calls:
            self.called.add(index)
        return r

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        if reason == "stop" and index in self.called and self.plan.choice != "named":
            return "tool_calls"
        return reason

    def message(self, index: int, text: str, reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """A whole (non-streamed) choice: (message, finish_reason)."""
        r = self.read(index, text, True)
        calls = merge_calls(r.calls)
        if (reason == "length" and len(calls) > 1 and self.plan.choice != "named"
                and not _is_json(calls[-1].arguments)):
            calls = calls[:-1]      # cut short by max_tokens: keep the whole calls before it
        msg: dict[str, Any] = {"role": "assistant", "content": r.content or None}
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg, self.finish_reason(index, reason)

    def delta(self, index: int, text: str, reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        """A streamed piece: (content / tool_calls, finish_reason); may be empty (the
        parser holds back text that may belong to a call)."""
        r = self.read(index, text, reason is not None)
        d: dict[str, Any] = {}
        if r.content:
            d["content"] = r.content
        if r.calls:
            d["tool_calls"] = [c.openai() for c in r.calls]
        return d, self.finish_reason(index, reason)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
