"""OpenAI request schemas (pydantic) and their mapping to SamplingParams.

Pydantic checks types (a wrong type is a 400 naming the field); value ranges and the
configurable limits are the input processor's job (engine/input_processor.py), so the
rules live in one place. The one exception: list-valued fields are refused above their
limit's hard ceiling (EngineArgs' `max=`) BEFORE pydantic validates their items, so that
a body of a million prompts or stop strings costs a length check, not seconds of
validation. Unknown fields are ignored, as vLLM does. Responses are built as plain dicts
in server/serving.py.
"""
from __future__ import annotations

from typing import Any, Literal

from dataclasses import fields
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

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

    _cap_prompt = field_validator("prompt", mode="before")(
        _capped("max_sequences_per_request"))

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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
