"""Engines on the canonical tiny model, built once per distinct set of arguments and shared
by every test of the session that asks for the same one.

Building an engine compiles every bucket of its step (seconds to minutes on two cores);
most engine tests only need *an* engine of a given shape and a clean state. `tiny_llm`
hands out the same `LLM` for equal arguments; `release` (the `tiny_llm_factory` fixture
calls it after each test) returns it to a clean state: every request aborted and drained,
the prefix cache forgotten, and every KV block asserted free, so a test that leaked a
block fails where it leaked, not in whichever test happens to share its engine next.

Only the few most recently used engines stay alive (`KEEP`): a session builds dozens
of distinct engines, and keeping every one would multiply the suite's memory on the
small machines it runs on; tests that share an engine mostly run one after another.

What a shared engine does not reset: its compile counter and its step / prefix-cache
statistics keep counting, so a test that asserts absolute values of those builds its own
engine (`fresh=True`), while "no recompiles after warm-up" is measured as a difference.
"""
from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Any

from engine_utils import tiny_config, tiny_tokenizer, tiny_weights
from jaxserve.frontend.llm import LLM

_Key = tuple[tuple[tuple[str, Any], ...], int, tuple[tuple[str, Any], ...]]
_POOL: "OrderedDict[_Key, LLM]" = OrderedDict()
KEEP = 3


def _frozen(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    def hashable(v: Any) -> Any:
        if isinstance(v, dict):
            return _frozen(v)
        return tuple(v) if isinstance(v, list) else v
    return tuple(sorted((k, hashable(v)) for k, v in d.items()))


def tiny_model(seed: int = 0, **config: Any) -> tuple[Any, Any, Any]:
    """(config, weights, tokenizer) of the tiny Llama (engine_utils), as tests build it."""
    cfg = tiny_config(**config)
    return cfg, tiny_weights(cfg, seed=seed), tiny_tokenizer(cfg.vocab_size)


def tiny_llm(config: dict[str, Any] | None = None, seed: int = 0, fresh: bool = False,
             **engine_args: Any) -> LLM:
    """The shared LLM on tiny_config(**config) with tiny_weights(seed) and EngineArgs
    (**engine_args); `fresh` builds a private one (a test that counts from zero)."""
    # the test's warm-up setting (tests/conftest.py) is part of what makes two engines equal
    engine_args.setdefault("warmup", LLM.from_weights.__func__.__kwdefaults__["warmup"])
    key = (_frozen(config or {}), seed, _frozen(engine_args))
    if key in _POOL and not fresh:
        _POOL.move_to_end(key)
        return _POOL[key]
    cfg, weights, tok = tiny_model(seed, **(config or {}))
    llm = LLM.from_weights(cfg, weights, tok, **engine_args)
    if not fresh:
        _POOL[key] = llm
        if len(_POOL) > KEEP:
            _POOL.popitem(last=False)
            gc.collect()
    return llm


def release(llm: LLM) -> None:
    """Abort what is left, drain the step in flight, forget the prefix cache and check
    that every KV block is free again (a shared engine must start the next test clean)."""
    engine = llm.engine
    engine.abort_requests(list(engine.scheduler.requests))
    while engine.has_unfinished_requests():
        engine.step()
    llm.processor.parents.clear()
    llm.processor.child_to_parent.clear()
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks, \
        f"{kv.num_blocks - kv.num_free_blocks} KV blocks still held after the test"
    assert engine.reset_prefix_cache(), "the prefix cache refused to reset"
    kv.pool.check()


def pooled() -> list[LLM]:
    return list(_POOL.values())
