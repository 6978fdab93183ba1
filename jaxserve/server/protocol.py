"""OpenAI request schemas (pydantic) and their mapping to SamplingParams.

Pydantic checks types strictly (a wrong type is a 400 naming the field): a string, a
bool or a float where an int is expected (`max_tokens: "16"`, `n: true`, a token id
1.0), a number where a bool or a string is expected, are refused rather than coerced,
as the OpenAI API documents; an int where a float is expected (`temperature: 1`) and
null for an optional field are fine. The body itself (UTF-8, nesting depth, lone
surrogates) is checked before any model sees it (server/json_body.py). Value ranges
and the configurable limits are the input processor's job (frontend/input_processor.py),
so the rules live in one place. The one exception: list-valued fields are refused above their
limit's hard ceiling (EngineArgs' `max=`) BEFORE pydantic validates their items, so that
a body of a million prompts or stop strings costs a length check, not seconds of
validation. Unknown fields are ignored, as vLLM does, but fields that would change what
is generated and are not implemented are refused with a 400 naming them (`_refuse`
below: best_of > n, suffix, non-text content parts, the legacy functions / function_call,
beam search, non-text modalities) rather than silently dropped. Structured outputs
(response_format, structured_outputs, guided_*) map to StructuredOutputsParams
(server/structured_fields.py). Tool calling (tools, tool_choice,
tool_calls and role "tool" in messages) is checked here for shape and consistency;
what the server supports (auto needs --enable-auto-tool-choice) in serving.py. The chat
template controls (ChatTemplateFields: chat_template_kwargs, continue_final_message, a
per-request chat_template) are shared by chat and /tokenize; `stream_options` is only
accepted with `stream: true`, as OpenAI's API says. Responses are built as plain dicts
in server/serving.py.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from dataclasses import fields
from typing import Callable

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from jaxserve.config import EngineArgs

from jaxserve.sampling.params import SamplingParams
from jaxserve.server.structured_fields import (ResponseFormat, StructuredOutputsField,
                                               structured_params)

_I64 = dict(ge=-(2 ** 63), le=2 ** 63 - 1)


def _ceiling(setting: str) -> int:
    return next(f.metadata["max"] for f in fields(EngineArgs) if f.name == setting)


def _capped(setting: str) -> Callable[[Any], Any]:
    """A before-validator: a list/dict longer than `setting`'s hard ceiling is refused."""
    cap = _ceiling(setting)

    def check(v: Any) -> Any:
        if isinstance(v, (list, dict)) and len(v) > cap:
            raise ValueError(f"at most {cap} items (--{setting.replace('_', '-')}), "
                             f"got {len(v)}")
        return v
    return check


def _refuse(ok: Callable[[Any, ValidationInfo], bool], why: str
            ) -> Callable[[Any, ValidationInfo], Any]:
    """A before-validator: a value that `ok` rejects is a 400 naming the field (its loc),
    saying why; values meaning "off" (null, empty, the default) pass."""
    def check(v: Any, info: ValidationInfo) -> Any:
        if not ok(v, info):
            raise PydanticCustomError("unsupported_field", "{why}", {"why": why})
        return v
    return check


def _off(v: Any, _: ValidationInfo) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


_LEGACY_FUNCTIONS = ("not supported: the legacy functions / function_call fields; use tools "
                     "and tool_choice")
# OpenAI's rule for function names (also what keeps them safe inside a prompt).
_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Base(BaseModel):
    # strict: every model of every route; a lax field would quietly turn "16" into 16
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False        # vLLM's: usage on every chunk


class _Sampling(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""
    model: str | None = None
    n: int = Field(1, **_I64)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, **_I64)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, **_I64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, **_I64)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: logprob tokens as "token_id:N" (for tokens that are not valid text alone)
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    cache_salt: str | None = None
    # vLLM's disaggregated prefill/decode hand-off (server/kv_params.py)
    kv_transfer_params: dict[str, Any] | None = None
    # jaxserve's extra field (vLLM has no per-request switch): false turns speculative
    # decoding off for this request; outputs are the same either way, only speed differs.
    # Strict: a string or a number is a 400 naming the field, not a guessed boolean.
    speculative: StrictBool | None = None
    # vLLM's extra field: the prompt's own logprobs (top k), returned as `prompt_logprobs`
    prompt_logprobs: int | None = Field(None, **_I64)
    # vLLM's rule is best_of >= n; jaxserve returns every sample, so only best_of == n
    best_of: int | None = Field(None, ge=1, le=_I64["le"])
    # Accepted only when off (see _refuse): jaxserve cannot honour it.
    use_beam_search: Any = None
    # structured outputs (server/structured_fields.py maps them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v < n:
            raise PydanticCustomError("best_of_below_n", "must be >= n ({n}), got {best_of}",
                                      {"n": n, "best_of": v})
        if v is not None and v > n:
            raise PydanticCustomError(
                "unsupported_field", "not supported above n: jaxserve returns every "
                "sample it generates (use n)")
        return v

    @field_validator("stream_options", mode="after")
    @classmethod
    def _only_when_streaming(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):
            raise PydanticCustomError("stream_options_without_stream",
                                      "only allowed when stream is true (OpenAI's rule)")
        return v

    _no_beam = field_validator("use_beam_search", mode="before")(_refuse(
        _off, "not supported: beam search is not implemented in jaxserve"))

    _cap_stop = field_validator("stop", mode="before")(_capped("max_stop_strings"))
    _cap_stop_ids = field_validator("stop_token_ids", mode="before")(
        _capped("max_stop_token_ids"))
    _cap_bias = field_validator("logit_bias", mode="before")(_capped("max_logit_bias"))

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises SamplingParamsError (a ValueError naming the param) for bad values."""
        d: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, logprobs=logprobs, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            seed=self.seed, logit_bias=self.logit_bias,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            prompt_logprobs=self.prompt_logprobs,
            speculative=self.speculative is not False)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        d["structured_outputs"] = structured_params(self)
        return SamplingParams(**d)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (continuous_usage_stats, with or without
        include_usage, which adds the final usage-only chunk)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, **_I64)
    logprobs: int | None = Field(None, **_I64)
    echo: bool = False
    suffix: str | None = None

    _no_suffix = field_validator("suffix", mode="before")(_refuse(
        _off, "not supported: jaxserve does not generate text to fit before a suffix"))
    _cap_prompt = field_validator("prompt", mode="before")(
        _capped("max_sequences_per_request"))

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: return the prompt (and its logprobs) only; one token
        is generated and dropped, as vLLM does."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        p = self._params(1 if self.echo_only else self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and p.prompt_logprobs is None:
            p.prompt_logprobs = self.logprobs    # echoed tokens carry logprobs (vLLM's rule)
        return p


class TextPart(_Base):
    type: Literal["text"]
    text: str


def _text_parts_only(v: Any, _: ValidationInfo) -> bool:
    return not isinstance(v, list) or all(
        not isinstance(p, dict) or p.get("type") == "text" for p in v)


class FunctionDefinition(_Base):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema; none: no arguments
    strict: bool | None = None


class ChatTool(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Base):
    name: str
    arguments: str                  # a JSON object, as text (OpenAI)


class ToolCall(_Base):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None        # assistant: calls it made
    tool_call_id: str | None = None                 # tool: the call this answers

    _text_only = field_validator("content", mode="before")(_refuse(
        _text_parts_only, "only text content parts are supported (type 'text'): the "
                          "model takes no images, audio, video or files"))

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id (the id of "
                             "the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatTemplateFields(_Base):
    """How messages become a prompt (vLLM's fields), on /v1/chat/completions and
    /tokenize alike. chat_template_kwargs are variables for the template (e.g.
    enable_thinking); a per-request chat_template is code, which the server runs only
    with --trust-request-chat-template (server/serving.py)."""
    add_generation_prompt: bool = True
    # the last message is left open and the model continues it (no end-of-turn marker)
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None

    @field_validator("continue_final_message", mode="after")
    @classmethod
    def _open_xor_new(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise PydanticCustomError(
                "continue_final_message", "cannot be true with add_generation_prompt true "
                "(set add_generation_prompt to false): the last message is either "
                "continued or followed by a new assistant turn")
        return v


class ChatCompletionRequest(_Sampling, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, **_I64)
    max_completion_tokens: int | None = Field(None, **_I64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **_I64)
    # vLLM's: the reply starts with the last message's content when that message is
    # the assistant's (server/chat_outputs.py)
    echo: bool = False
    # None: "auto" when tools are given, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None

    _no_functions = field_validator("functions", "function_call", mode="before")(_refuse(
        lambda v, _: v is None or v == [] or v == "none", _LEGACY_FUNCTIONS))

    @field_validator("tool_choice", mode="after")
    @classmethod
    def _choice_in_tools(cls, v: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if v == "required" and not names:
            raise PydanticCustomError("invalid_tool_choice",
                                      "'required' needs at least one tool in tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise PydanticCustomError(
                "invalid_tool_choice", "names the function '{name}', which is not in "
                "tools (tools: {names})", {"name": v.function.name, "names": names})
        return v

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice
    _text_out = field_validator("modalities", mode="before")(_refuse(
        lambda v, _: v is None or v == ["text"], "only [\"text\"] is supported: jaxserve "
                                                 "generates text"))
    _no_audio = field_validator("audio", mode="before")(_refuse(
        _off, "not supported: jaxserve generates text"))

    def sampling_params(self) -> SamplingParams:
        mt = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(mt, lp)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates take them (tool calls with their arguments as
        dicts, as HF templates expect; server/chat_template.py rewrites them for
        templates that know no tools)."""
        # "developer" is OpenAI's new name for "system"; templates know only the latter.
        out: list[dict[str, Any]] = []
        for m in self.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":     # some templates show it
                d["name"] = m.name
            out.append(d)
        return out


def _arguments(text: str) -> Any:
    """A past call's arguments as a dict (the text as is when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class EmbeddingRequest(_Base):
    """OpenAI's /v1/embeddings body (server/embeddings.py serves it)."""
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, **_I64)
    user: str | None = None

    _cap_input = field_validator("input", mode="before")(_capped("max_sequences_per_request"))


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class LoadLoRAAdapterRequest(_Base):
    """POST /v1/load_lora_adapter (vLLM's body): a name and a local adapter directory."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Base):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
