"""SamplingParams: per-request generation controls (vLLM/OpenAI names), and their checks.

Checks run twice: the request-intrinsic ones in __post_init__ (a SamplingParams that
exists is sane), and again with the engine's limits and vocabulary at the entry point
(frontend/input_processor.py, which also fills defaults and re-checks the result). A
failure raises SamplingParamsError, a ValueError whose `.param` names the offending
field so that the server can answer 400 with OpenAI's `param`.

Every value ends up in a fixed-width device array (sampling/metadata.py): integers in
int32 (seeds as two uint32 words), floats in float32. So integers are range-checked
against int32 and floats must be finite *as float32* (1e39 is a finite double but inf
in float32, and inf temperature samples NaN).
"""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Static widths of the sampler's sparse per-row tables (see sampling/metadata.py).
MAX_LOGIT_BIAS = 64             # logit_bias entries per request
MAX_MIN_TOKENS_STOP_IDS = 24    # stop_token_ids suppressed by min_tokens (EOS ids extra)
INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)   # int64 or uint64; folded into two uint32 words
# Repetition penalty divides (or multiplies) logits on the device: kept where the
# result stays finite in float32 even after a greedy-threshold temperature (1e-5).
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


class RequestOutputKind(enum.Enum):
    """What a request's stream of RequestOutputs carries (vLLM's names and values).

    CUMULATIVE  each output holds everything generated so far (the default)
    DELTA       each output holds only what is new since the previous one (text, token
                ids, logprobs); the finished one carries the last piece and the reason
    FINAL_ONLY  one output, when the request has finished
    """
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `param` is the field's name, `code` an optional
    OpenAI error code (e.g. context_length_exceeded); `message` the text without the
    param's name (an error with a code is OpenAI's own, and clients match its wording)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.code = code
        self.message = message


# the longest reasoning end sequence (token ids): the device automaton keeps this many of
# each constrained slot's last tokens to spot it (structured/device_pool.py)
MAX_REASONING_END = 8


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names): exactly one of
    json (a JSON schema, as a dict or a JSON string), json_object (any JSON object),
    regex, choice (one of these strings) or grammar (EBNF / Lark text). The grammar
    itself is checked when it is compiled (jaxserve/structured/); here only the shape.

    reasoning_end: for a reasoning model, the token ids that end its reasoning (the
    server sets them from `</think>`): the output is free until it has generated them,
    and the constraint holds from the token after them. None: from the first token."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning_end: list[int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs", "exactly one of json, json_object, regex, choice, "
                                      f"grammar must be given, got {given or 'none'}")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError(
                "structured_outputs", "choice must be a non-empty list of non-empty strings")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError("structured_outputs", f"{k} must be a non-empty string")
        if self.reasoning_end is not None:
            end = self.reasoning_end
            if (not isinstance(end, (list, tuple)) or not 1 <= len(end) <= MAX_REASONING_END
                    or not all(_is_int(t) and t >= 0 for t in end)):
                raise SamplingParamsError(
                    "structured_outputs", f"reasoning_end must be 1 to {MAX_REASONING_END} "
                                          "token ids")
            self.reasoning_end = [int(t) for t in end]


def _is_int(x: object) -> bool:      # numbers.* also admits numpy scalars
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_num(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _in_range(x: object, lo: float, hi: float) -> bool:
    return _is_num(x) and lo <= x <= hi    # False for NaN


def _int_in(x: object, lo: int, hi: int) -> bool:
    return _is_int(x) and lo <= x <= hi


def _finite32(x: object) -> bool:
    """A real number that is finite once stored as float32 (False for NaN/inf/1e39)."""
    return _is_num(x) and math.isfinite(x) and abs(x) <= FLOAT32_MAX


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0           # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                    # -1 (or 0) = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # speculative decoding (when the engine has a speculative_config): False turns it
    # off for this request (its tokens are the same either way; only speed differs)
    speculative: bool = True
    # an embedding request (model/pooling.py): the prompt's pooled final hidden state
    # comes back (RequestOutput.pooled) and its one sampled token is not output text;
    # only an engine serving embeddings takes it
    pooled: bool = False
    # vLLM's extension point; jaxserve reads extra_args["kv_transfer_params"] (the
    # disaggregated prefill/decode hand-off, kv_transfer/connector.py)
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:          # an unknown key
                raise SamplingParamsError("structured_outputs", str(e)) from None
        if not isinstance(self.output_kind, RequestOutputKind):
            try:        # vLLM's integer values are accepted too
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise SamplingParamsError(
                    "output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}"
                ) from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:   # JSON object keys arrive as strings
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise SamplingParamsError(
                    "logit_bias", "must map token ids to numbers") from None
        self.validate(max_n=None, max_logprobs=None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, *, max_n: int | None = 16, max_logprobs: int | None = 20,
                 vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError for the first bad field. A limit of None is not
        checked (__post_init__ checks without the engine's limits)."""
        self._check_sampling()
        self._check_lengths()
        self._check_token_ids(vocab_size)
        if self.pooled and (self.n != 1 or self.max_tokens != 1):
            raise SamplingParamsError("n", "a pooling request has n = 1 and max_tokens = 1")
        if not _int_in(self.n, 1, INT32_MAX):
            raise SamplingParamsError("n", f"must be an integer >= 1, got {self.n!r}")
        if max_n is not None and self.n > max_n:
            raise SamplingParamsError("n", f"must be <= {max_n}, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is None:
                continue
            if not _int_in(v, 0, INT32_MAX):
                raise SamplingParamsError(name, f"must be an integer >= 0, got {v!r}")
            if max_logprobs is not None and v > max_logprobs:
                raise SamplingParamsError(name, f"must be <= {max_logprobs}, got {v}")
        if self.seed is not None and not _int_in(self.seed, *SEED_RANGE):
            raise SamplingParamsError(
                "seed", f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], "
                        f"got {self.seed!r}")

    def _check_sampling(self) -> None:
        t = self.temperature
        if not (_finite32(t) and t >= 0):
            raise SamplingParamsError(
                "temperature", f"must be a number in [0, {FLOAT32_MAX:.4g}] (finite in "
                               f"float32), got {t!r}")
        # float32(1e-50) is 0: a top_p that vanishes on the device is refused too.
        if not (_is_num(self.top_p) and 0 < self.top_p <= 1 and np.float32(self.top_p) > 0):
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _int_in(self.top_k, -1, INT32_MAX):
            raise SamplingParamsError(
                "top_k", f"must be -1 or 0 (off) or an integer in [1, {INT32_MAX}], "
                         f"got {self.top_k!r}")
        if not _in_range(self.min_p, 0.0, 1.0):
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in_range(getattr(self, name), -2.0, 2.0):
                raise SamplingParamsError(
                    name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _in_range(self.repetition_penalty, lo, hi):
            raise SamplingParamsError(
                "repetition_penalty",
                f"must be in [{lo:g}, {hi:g}], got {self.repetition_penalty!r}")

    def _check_lengths(self) -> None:
        mt = self.max_tokens
        if mt is not None and not _int_in(mt, 1, INT32_MAX):
            raise SamplingParamsError(
                "max_tokens", f"must be an integer in [1, {INT32_MAX}], got {mt!r}")
        if not _int_in(self.min_tokens, 0, INT32_MAX):
            raise SamplingParamsError(
                "min_tokens", f"must be an integer in [0, {INT32_MAX}], got {self.min_tokens!r}")
        if mt is not None and self.min_tokens > mt:
            raise SamplingParamsError(
                "min_tokens", f"must be <= max_tokens ({mt}), got {self.min_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop strings must be non-empty, got {s!r}")

    def _check_token_ids(self, vocab_size: int | None) -> None:
        top = INT32_MAX if vocab_size is None else vocab_size - 1

        def in_vocab(t: object) -> bool:
            return _int_in(t, 0, top)

        where = f", {top + 1}"
        for t in self.stop_token_ids:
            if not in_vocab(t):
                raise SamplingParamsError(
                    "stop_token_ids", f"token ids must be integers in [0{where}), got {t!r}")
        if self.min_tokens > 0 and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS:
            raise SamplingParamsError(
                "stop_token_ids",
                f"at most {MAX_MIN_TOKENS_STOP_IDS} with min_tokens > 0, "
                f"got {len(self.stop_token_ids)}")
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for t, v in bias.items():
            if not in_vocab(t):
                raise SamplingParamsError(
                    "logit_bias", f"token ids must be in [0{where}), got {t!r}")
            if not _in_range(v, -100.0, 100.0):
                raise SamplingParamsError(
                    "logit_bias", f"biases must be in [-100, 100], got {v!r} for token {t}")
