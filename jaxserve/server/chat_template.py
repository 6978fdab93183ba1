"""Chat messages (and tools) -> prompt token ids, through the tokenizer's chat template.

A template that renders tools (Qwen's, Hermes', Llama 3.1's, ...) gets them as
`tools=` and the messages in OpenAI's shape (past calls' arguments as dicts). Many
templates ignore tools, SmolLM2's among them; that is detected once per tokenizer (a
probe conversation rendered with and without a tool comes out the same), and then the
fallback writes what the template would not (docs/serving.md, "Tool calling"):

    - a system message describing the tools (their JSON) and how to write a call,
      added to the conversation's own system message if it has one
    - past calls inside the assistant's text, written as the call parser reads them
    - tool results wrapped in <tool_response></tool_response>

A request may bring its own template (`chat_template`, only on a server run with
--trust-request-chat-template), variables for it (`chat_template_kwargs`, e.g.
`enable_thinking` for Qwen3's) and `continue_final_message` (the last message is left
open for the model to continue: no end-of-turn marker, no generation prompt).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatTemplateFields
from jaxserve.server.tool_parsers import ToolParser

_PROBE = [{"role": "user", "content": "hi"}]
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_7f3a", "description": "a probe",
    "parameters": {"type": "object", "properties": {}}}}


# apply_chat_template's own arguments: chat_template_kwargs may not set them (they are
# the request's other fields, or would change what the call returns)
RESERVED_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens"))


@dataclass(slots=True)
class TemplateOptions:
    """A request's say in the rendering (its vLLM fields)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template: str | None = None                  # the request's own (trusted servers)
    kwargs: dict[str, Any] = field(default_factory=dict)    # template variables


def template_options(req: ChatTemplateFields, trusted: bool) -> TemplateOptions:
    """The request's template fields, checked: its own template only on a server that
    trusts them (`trusted`: --trust-request-chat-template; a template is code the
    server runs)."""
    if req.chat_template is not None and not trusted:
        raise APIError(400, "chat_template: a per-request chat template is code the "
                            "server would run; this server is not started with "
                            "--trust-request-chat-template, so it is not supported",
                       param="chat_template")
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set "
                            f"here (a request field of its own or the renderer's)",
                       param="chat_template_kwargs")
    return TemplateOptions(req.add_generation_prompt, req.continue_final_message,
                           req.chat_template, kwargs)


class ChatRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._takes_tools: bool | None = None

    def takes_tools(self, template: str | None = None) -> bool:
        """Does the template render `tools`? (The server's is probed once: a template
        does not change; a request's own template is probed each time.)"""
        if template is None and self._takes_tools is not None:
            return self._takes_tools
        try:
            apply = self.tokenizer.apply_chat_template
            takes = bool(apply(_PROBE, tools=[_PROBE_TOOL], tokenize=False,
                               chat_template=template)
                         != apply(_PROBE, tokenize=False, chat_template=template))
        except Exception:  # noqa: BLE001 - a template that chokes on tools takes none
            takes = False
        if template is None:
            self._takes_tools = takes
        return takes

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               style: type[ToolParser], opts: TemplateOptions | None = None) -> list[int]:
        """Token ids of the prompt. `style`: the call format the fallback writes.
        Raises what the template raises (the caller answers 400)."""
        opts = opts or TemplateOptions()
        uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool"
                                        for m in messages)
        if uses_tools and not self.takes_tools(opts.template):
            messages, tools = fallback_messages(messages, tools, style), None
        kw: dict[str, Any] = {**opts.kwargs, **({"tools": tools} if tools else {})}
        ids = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=opts.add_generation_prompt,
            continue_final_message=opts.continue_final_message, chat_template=opts.template,
            **kw)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      style: type[ToolParser]) -> list[dict[str, Any]]:
    """The conversation as plain role/content messages that any template renders."""
    out = []
    for m in messages:
        content = m["content"]
        if m.get("tool_calls"):
            calls = [style.render_call(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        if m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        prompt = tools_prompt(tools, style)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def tools_prompt(tools: list[dict[str, Any]], style: type[ToolParser]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help with the user's request. Each function is "
            "described by a JSON schema inside <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n{style.call_format()}\n"
            "Results of calls come back inside <tool_response></tool_response>.")
