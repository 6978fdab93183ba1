"""Structured-outputs constraint -> device automaton tables, cached.

    compiler = DeviceCompiler.for_tokenizer(tokenizer, eos_ids, vocab_size)
    key, tables = compiler.compile(sampling_params.structured_outputs)   # or NotOnDevice

The key is the constraint's regex: requests with the same schema / regex / choice
share one compiled table (and one copy in the device pool). Thread-safe, so the
compile can run off the engine thread. A constraint that cannot run on the device
(NotOnDevice: json_object, grammar, recursive schema, over the size limits) is
remembered too, so the next such request does not try again.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from jaxserve.structured.device_automaton import (AutomatonLimits, AutomatonTables,
                                                  NotOnDevice, compile_tables, device_regex)
from jaxserve.structured.device_vocab import TokenVocabulary


class DeviceCompiler:
    def __init__(self, vocab_fn: Any, limits: AutomatonLimits = AutomatonLimits(),
                 cache_size: int = 64) -> None:
        """vocab_fn: () -> TokenVocabulary (built on first use: ~0.1 s for 50k tokens)."""
        self._vocab_fn = vocab_fn
        self._vocab: TokenVocabulary | None = None
        self.limits = limits
        self.cache_size = cache_size
        self._cache: OrderedDict[str, AutomatonTables | NotOnDevice] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: dict[str, float] = {}     # regex -> seconds (last compiles)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, eos_token_ids: tuple[int, ...], vocab_size: int,
                      **kw: Any) -> "DeviceCompiler":
        return cls(lambda: TokenVocabulary.from_tokenizer(tokenizer, eos_token_ids,
                                                          vocab_size), **kw)

    @property
    def vocab(self) -> TokenVocabulary:
        with self._lock:
            if self._vocab is None:
                self._vocab = self._vocab_fn()
            return self._vocab

    def compile(self, so: Any) -> tuple[str, AutomatonTables]:
        """(key, tables) for a StructuredOutputsParams; NotOnDevice if it must take the
        host path."""
        regex = device_regex(so)
        with self._lock:
            hit = self._cache.get(regex)
            if hit is not None:
                self._cache.move_to_end(regex)
        if hit is None:
            t0 = time.perf_counter()
            try:
                hit = compile_tables(regex, self.vocab, self.limits)
            except NotOnDevice as e:
                hit = e
            with self._lock:
                self.compile_seconds[regex] = time.perf_counter() - t0
                self._cache[regex] = hit
                while len(self._cache) > self.cache_size:
                    old, _ = self._cache.popitem(last=False)
                    self.compile_seconds.pop(old, None)
        if isinstance(hit, NotOnDevice):
            raise hit
        return regex, hit


class DeviceStructured:
    """The engine's side of the device path: compile a request's constraint and
    reserve its tables in the runner's pool (structured/device_pool.DeviceAutomata).

    admit() -> True: the constraint runs on the device (the runner starts the slot
    when the request is scheduled, and releases it when the request finishes);
    False: not constrained, or it must take the host path (not regular, over the size
    limits, or the pool is full)."""

    def __init__(self, compiler: DeviceCompiler, automata: Any) -> None:
        self.compiler = compiler
        self.automata = automata
        self.last_fallback: str | None = None       # why the last request went to the host

    def admit(self, request: Any) -> bool:
        so = getattr(request.sampling_params, "structured_outputs", None)
        if so is None:
            return False
        try:
            key, tables = self.compiler.compile(so)
        except NotOnDevice as e:
            self.last_fallback = str(e)
            return False
        if not self.automata.attach(request.request_id, key, tables):
            self.last_fallback = "the device automaton pool is full"
            return False
        return True

    def release(self, req_id: str) -> None:
        """A request admitted here never reached the runner (refused after admit)."""
        self.automata.detach(req_id)
