"""OpenAI request schemas (pydantic) and their mapping to SamplingParams.

Pydantic checks types (a wrong type is a 400 naming the field); value ranges and the
configurable limits are the input processor's job (engine/input_processor.py), so the
rules live in one place. The one exception: list-valued fields are refused above their
limit's hard ceiling (EngineArgs' `max=`) BEFORE pydantic validates their items, so that
a body of a million prompts or stop strings costs a length check, not seconds of
validation. Unknown fields are ignored, as vLLM does, but fields that would change what
is generated and are not implemented are refused with a 400 naming them (`_refuse`
below: best_of > n, suffix, non-text content parts, response_format other than text,
guided_* / structured_outputs, tools / tool_choice / functions, tool_calls in messages,
beam search, non-text modalities) rather than silently dropped. Responses are built as
plain dicts in server/serving.py.
"""
from __future__ import annotations

from typing import Any, Literal

from dataclasses import fields
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from jaxserve.config import EngineArgs

from jaxserve.sampling.params import SamplingParams

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


def _best_of_ok(v: Any, info: ValidationInfo) -> bool:
    return v is None or (isinstance(v, int) and v <= info.data.get("n", 1))


_STRUCTURED = ("not supported: structured outputs are not implemented in jaxserve yet; "
               "leave it out")
_TOOLS = ("not supported: tool calling is not implemented in jaxserve yet; leave it out "
          "(or use tool_choice 'none' without tools)")


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


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
    user: str | None = None
    cache_salt: str | None = None
    # Accepted only when off (see _refuse): jaxserve cannot honour them.
    best_of: int | None = Field(None, **_I64)
    use_beam_search: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    _no_best_of = field_validator("best_of", mode="before")(_refuse(
        _best_of_ok, "not supported above n: jaxserve returns every sample it generates "
                     "(use n)"))
    _no_beam = field_validator("use_beam_search", mode="before")(_refuse(
        _off, "not supported: beam search is not implemented in jaxserve"))
    _no_format = field_validator("response_format", mode="before")(_refuse(
        lambda v, _: v is None or v == {"type": "text"}, "only {\"type\": \"text\"} is "
        "supported: structured outputs (json_object, json_schema) are not implemented in "
        "jaxserve yet"))
    _no_guided = field_validator("structured_outputs", "guided_json", "guided_regex",
                                 "guided_choice", "guided_grammar", mode="before")(
        _refuse(lambda v, _: v is None, _STRUCTURED))

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
            stop_token_ids=list(self.stop_token_ids or []))
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        return SamplingParams(**d)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


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

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)


class TextPart(_Base):
    type: Literal["text"]
    text: str


def _text_parts_only(v: Any, _: ValidationInfo) -> bool:
    return not isinstance(v, list) or all(
        not isinstance(p, dict) or p.get("type") == "text" for p in v)


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None

    _text_only = field_validator("content", mode="before")(_refuse(
        _text_parts_only, "only text content parts are supported (type 'text'): the "
                          "model takes no images, audio, video or files"))
    _no_tool_calls = field_validator("tool_calls", mode="before")(_refuse(_off, _TOOLS))

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, **_I64)
    max_completion_tokens: int | None = Field(None, **_I64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **_I64)
    add_generation_prompt: bool = True
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None

    _no_tools = field_validator("tools", "functions", mode="before")(_refuse(_off, _TOOLS))
    _no_tool_choice = field_validator("tool_choice", "function_call", mode="before")(_refuse(
        lambda v, _: v is None or v == "none", _TOOLS))
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

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's new name for "system"; templates know only the latter.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
