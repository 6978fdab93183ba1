"""SpeculativeConfig: `speculative_config` as vLLM names it, validated once.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    jaxserve serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    speculative_config: {method: ngram, num_speculative_tokens: 4}        # YAML
    {"method": "self", "draft_num_layers": 8, "num_speculative_tokens": 3}
    {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 3}

EngineArgs keeps the mapping as given (so YAML, JSON and kwargs stay one value);
`SpeculativeConfig.from_dict` is the one place it is checked and defaulted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "self", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A bad speculative_config; the message names the key."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str                              # "ngram", "self" or "draft_model"
    num_speculative_tokens: int              # k: tokens proposed (and verified) per step
    prompt_lookup_max: int | None = None     # ngram: longest n-gram matched
    prompt_lookup_min: int | None = None     # ngram: shortest n-gram matched
    disable_by_batch_size: int | None = None # no speculation in steps with more requests
    draft_num_layers: int | None = None      # self: layers of the target that propose
    model: str | None = None                 # draft_model: the draft checkpoint

    @classmethod
    def from_dict(cls, d: Any) -> "SpeculativeConfig":
        """Check and default a user's mapping (or JSON text); SpeculativeConfigError
        with a message naming the key."""
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise SpeculativeConfigError(
                f"speculative_config: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        method = d.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method: {method!r} is not one of {list(METHODS)}")
        k = _int(d, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, required=True)
        batch = _int(d, "disable_by_batch_size", 1, 1 << 20)
        if method != "ngram":
            return cls._draft(d, method, k, batch)
        lo = _int(d, "prompt_lookup_min", 1, 1024)
        hi = _int(d, "prompt_lookup_max", 1, 1024)
        # vLLM's rule: one given sets the other; neither: 2..5 here (vLLM: 5..5)
        if lo is None and hi is None:
            lo, hi = 2, 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise SpeculativeConfigError(
                f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                f"prompt_lookup_max ({hi})")
        return cls(method, k, hi, lo, batch)

    @classmethod
    def _draft(cls, d: dict, method: str, k: int, batch: int | None) -> "SpeculativeConfig":
        """self / draft_model: their one key each (checked against the target model
        when the engine is built: worker/drafter/draft.py)."""
        own = {"self": "draft_num_layers", "draft_model": "model"}
        stray = sorted(key for key in ("prompt_lookup_min", "prompt_lookup_max",
                                       *own.values())
                       if d.get(key) is not None and key != own[method])
        if stray:
            raise SpeculativeConfigError(
                f"speculative_config: {stray} do not apply to method {method!r}")
        if method == "self":
            layers = _int(d, "draft_num_layers", 1, 1 << 16, required=True)
            return cls(method, k, disable_by_batch_size=batch, draft_num_layers=layers)
        model = d.get("model")
        if not isinstance(model, str) or not model:
            raise SpeculativeConfigError(
                "speculative_config.model is required for method 'draft_model': the "
                f"draft checkpoint's path, got {model!r}")
        return cls(method, k, disable_by_batch_size=batch, model=model)


def _int(d: dict, key: str, lo: int, hi: int, required: bool = False) -> int | None:
    v = d.get(key)
    if v is None:
        if required:
            raise SpeculativeConfigError(f"speculative_config.{key} is required")
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise SpeculativeConfigError(
            f"speculative_config.{key}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v
