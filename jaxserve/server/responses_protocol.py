"""The request schema of POST /v1/responses (OpenAI's Responses API) and its rendering
into a /v1/chat/completions request.

A Responses request is served by the chat path (server/serving.py): its input items
become chat messages, `instructions` a leading system message, `text.format` the chat
`response_format`, function `tools` the chat tools, so sampling, structured outputs and
tool calling are the chat path's, with its checks. What the chat path cannot do (hosted
tools, images and files, background runs, server-side conversations, truncation) is a
400 naming the field, never silently dropped; fields that only describe the client
(metadata, user, service_tier, prompt_cache_key, ...) are accepted.

`reasoning` ({"effort": ..., "summary": ...}) is accepted and echoed but changes nothing,
as in vLLM, which reads effort only for gpt-oss's own prompt format: a reasoning model
served here thinks as its chat template lets it (for Qwen3 that is
chat_template_kwargs' enable_thinking, not a Responses field), and no reasoning summary
is written. Reasoning items a client gives back in `input` are dropped, as chat
templates drop earlier turns' reasoning.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from jaxserve.server.protocol import ChatCompletionRequest, FunctionDefinition

class _Base(BaseModel):
    # strict and lenient about unknown fields, as server/protocol.py's models
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


def _unsupported(why: str) -> Any:
    """A before-validator refusing any value but "off" (null, false, empty)."""
    def check(v: Any, _: ValidationInfo) -> Any:
        if not (v is None or v is False or v == [] or v == {} or v == ""):
            raise ValueError(f"not supported: {why}")
        return v
    return check


class ContentPart(_Base):
    # input_text (user input), output_text (an assistant turn given back), text (lenient)
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Base):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for p in v:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind not in ("input_text", "output_text", "text"):
                    raise ValueError(f"content part type {kind!r} is not supported: only "
                                     "input_text / output_text (the model takes no images, "
                                     "audio or files)")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Base):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Base):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(BaseModel):
    """A reasoning item of an earlier output, given back: accepted, not rendered."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem


class ReasoningConfig(_Base):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionTool(FunctionDefinition):
    """A Responses function tool: the chat tool's function, flattened (same name rule)."""
    type: Literal["function"]


class FunctionToolChoice(_Base):
    type: Literal["function"]
    name: str


class TextFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Base):
    format: TextFormat | None = None
    verbosity: str | None = None        # a hint to hosted models; nothing to do here


class ResponsesRequest(_Base):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    # any int64: its range is the input processor's check (a 400 naming the field)
    max_output_tokens: int | None = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None     # accepted, ignored (module doc)
    # refused unless off: the chat path has nothing that honours them
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    include: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    truncation: Any = None

    _no_background = field_validator("background", mode="before")(_unsupported(
        "background responses (this server answers while the request is open)"))
    _no_conversation = field_validator("conversation", mode="before")(_unsupported(
        "server-side conversations; chain responses with previous_response_id"))
    _no_prompt = field_validator("prompt", mode="before")(_unsupported(
        "stored prompt templates; send input and instructions"))
    _no_include = field_validator("include", mode="before")(_unsupported(
        "extra output data (include)"))
    _no_max_calls = field_validator("max_tool_calls", mode="before")(_unsupported(
        "max_tool_calls"))
    _no_top_logprobs = field_validator("top_logprobs", mode="before")(_unsupported(
        "logprobs on /v1/responses; use /v1/chat/completions"))

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_truncation(cls, v: Any) -> Any:
        if v not in (None, "disabled"):
            raise ValueError("only 'disabled' is supported: a prompt longer than the "
                             "context is refused, not cut")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        for t in v if isinstance(v, list) else ():
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise ValueError(f"tool type {kind!r} is not supported: only function "
                                 "tools (hosted tools run on OpenAI's servers)")
        return v

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that serves this one: `history` (the stored conversation
        of previous_response_id, as chat messages) then this input. Raises
        pydantic.ValidationError when the rendered conversation is no valid chat."""
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions else []) + history + self.input_messages()
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p,
                                "parallel_tool_calls": self.parallel_tool_calls}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": {
                    "name": fmt.name, "description": fmt.description,
                    "schema": fmt.json_schema, "strict": fmt.strict}}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        return ChatCompletionRequest.model_validate(body, strict=False)

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages: consecutive function_call items join
        the assistant turn before them; a function_call_output is a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, ReasoningInputItem):
                continue
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": item.output})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": None})
                out[-1].setdefault("tool_calls", []).append(call)
        return out


# Responses field names for the chat fields a chat-path error may name.
CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens",
                           "max_completion_tokens": "max_output_tokens",
                           "response_format": "text", "structured_outputs": "text"}
