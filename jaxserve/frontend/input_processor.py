"""InputProcessor: request intake, written once, used by `LLM` and by the server (through
AsyncEngine.add_request, which every HTTP request goes through).

Defaults are filled in FIRST and the final parameters are checked after: a check on the
user's values alone is bypassed by a default (a chat request with `min_tokens` 3e9 and
no `max_tokens` once passed, then overflowed an int32 array on the engine thread and
killed the engine). Cheap size bounds run before tokenization, so an oversized request
costs no tokenizer or chat-template time.

    inputs = InputProcessor(InputLimits.from_args(args), vocab_size=V, max_model_len=L)
    inputs.check_params(params)                      # limits + vocabulary (SamplingParams)
    await inputs.acheck_structured(params)           # the constraint, off the event loop
    inputs.check_request(num_prompts, params.n, texts)  # before tokenizing
    ids, final = inputs.process(prompt_ids, params)  # defaulted copy, checked again

Every failure is a SamplingParamsError (a ValueError) naming the parameter; the server
answers it with HTTP 400 and OpenAI's error object.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable

from jaxserve.sampling.params import SamplingParams, SamplingParamsError


@dataclass(slots=True, frozen=True)
class InputLimits:
    """Per-request bounds (EngineArgs fields of the same names; see `--help`)."""
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 64
    max_sequences_per_request: int = 1024
    max_input_chars: int = 1 << 20

    @classmethod
    def from_args(cls, args: Any) -> "InputLimits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


class InputProcessor:
    def __init__(self, limits: InputLimits, *, vocab_size: int, max_model_len: int) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    # ---- before tokenization ------------------------------------------------------------
    def check_params(self, params: SamplingParams) -> None:
        """The user's parameters against the engine's limits and vocabulary."""
        lim = self.limits
        params.validate(max_n=lim.max_n, max_logprobs=lim.max_logprobs,
                        vocab_size=self.vocab_size)
        _at_most("stop", len(params.stop), lim.max_stop_strings, "stop strings")
        longest = max((len(s) for s in params.stop), default=0)
        if longest > lim.max_stop_string_chars:
            raise SamplingParamsError(
                "stop", f"stop strings may be at most {lim.max_stop_string_chars} "
                        f"characters long, got one of {longest}")
        _at_most("stop_token_ids", len(params.stop_token_ids), lim.max_stop_token_ids,
                 "stop token ids")
        _at_most("logit_bias", len(params.logit_bias or {}), lim.max_logit_bias, "entries")

    # The schema / regex / grammar is parsed and checked at intake (a 400 naming the
    # problem), in a pool and by a deadline (structured/grammar.py): the check of a
    # hostile grammar can take a second, which must stall neither the caller's thread
    # nor the event loop. Its compile for the tokenizer runs later, in the engine's pool.
    def check_structured(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            from jaxserve.structured.grammar import validate
            validate(params.structured_outputs)

    async def acheck_structured(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            from jaxserve.structured.grammar import validate_async
            await validate_async(params.structured_outputs)

    def check_request(self, num_prompts: int, n: int, texts: Iterable[str] = (),
                      what: str = "prompt") -> None:
        """One request's size: prompts x n sequences, and characters of prompt text
        (`what` names the request field holding them: prompt or messages)."""
        lim = self.limits
        if num_prompts * n > lim.max_sequences_per_request:
            raise SamplingParamsError(
                "n" if n > 1 and num_prompts <= lim.max_sequences_per_request else what,
                f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences; at most "
                f"{lim.max_sequences_per_request} per request")
        chars = 0
        for t in texts:
            chars += len(t)
            if chars > lim.max_input_chars:
                raise SamplingParamsError(
                    what, f"the input is longer than {lim.max_input_chars} characters")

    # ---- after tokenization -------------------------------------------------------------
    def check_prompt_ids(self, ids: Iterable[Any], what: str = "prompt") -> list[int]:
        """-> the ids as a list of ints, each in [0, vocab_size)."""
        out = list(ids)
        v = self.vocab_size
        for t in out:
            if not (isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < v):
                raise SamplingParamsError(
                    what, f"prompt token ids must be integers in [0, {v}), got {t!r}")
        if not out:
            raise SamplingParamsError(what, "the prompt is empty")
        return [int(t) for t in out]

    def process(self, prompt_ids: Iterable[Any], params: SamplingParams,
                what: str = "prompt") -> tuple[list[int], SamplingParams]:
        """-> (prompt ids, a copy of params with defaults filled in), both checked."""
        ids = self.check_prompt_ids(prompt_ids, what)
        self.check_params(params)
        if params.pooled:
            self._check_pooled_length(len(ids), what)
        else:
            self._check_length(len(ids), params.max_tokens, what)
        final = replace(params)
        if final.max_tokens is None:
            final.max_tokens = self.max_model_len - len(ids)
            if final.min_tokens > final.max_tokens:
                raise SamplingParamsError(
                    "min_tokens", f"must be <= max_tokens, which defaults to {final.max_tokens}"
                                  f" (max_model_len {self.max_model_len} - {len(ids)} prompt "
                                  f"tokens) here; got {final.min_tokens}")
        self.check_params(final)        # the final values: whatever a default changed
        return ids, final

    def _check_length(self, num_ids: int, max_tokens: int | None, what: str) -> None:
        wanted = num_ids + (max_tokens or 1)
        if wanted <= self.max_model_len:
            return
        param = what if max_tokens is None or num_ids >= self.max_model_len else "max_tokens"
        raise SamplingParamsError(
            param, f"This model's maximum context length is {self.max_model_len} tokens. "
                   f"However, you requested {wanted} tokens ({num_ids} in the {what}, "
                   f"{max_tokens or 1} in the completion). Please reduce the length of the "
                   f"{what} or completion.", code="context_length_exceeded")


    def _check_pooled_length(self, num_ids: int, what: str) -> None:
        """An embedding's input may fill the whole context (its sampled token is never
        stored); vLLM's wording for the rest."""
        if num_ids > self.max_model_len:
            raise SamplingParamsError(
                what, f"This model's maximum context length is {self.max_model_len} "
                      f"tokens. However, you requested {num_ids} tokens in the input for "
                      f"embedding generation. Please reduce the length of the input.",
                code="context_length_exceeded")


def _at_most(param: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise SamplingParamsError(param, f"at most {limit} {what} per request, got {count}")
