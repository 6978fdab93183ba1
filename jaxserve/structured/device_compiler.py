"""Structured-outputs constraint -> device automaton tables, cached.

    compiler = DeviceCompiler.for_tokenizer(tokenizer, eos_ids, vocab_size)
    key, tables = compiler.compile(sampling_params.structured_outputs, wait_s=5.0)

The key is the constraint's regex: requests with the same schema / regex / choice
share one compiled table (and one copy in the device pool). Compiles run in a worker
thread (outlines-core releases the GIL while it builds the Index); the caller waits
at most wait_s, then gets NotOnDevice (the host path takes that request) while the
compile finishes in the background for the requests that come later. A constraint
that cannot run on the device (json_object, grammar, recursive schema, over the size
limits) is remembered too, so the next such request does not try again.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from jaxserve.structured.device_automaton import (AutomatonLimits, AutomatonTables,
                                                  NotOnDevice, compile_tables, device_regex)
from jaxserve.structured.device_vocab import TokenVocabulary

DEVICE_COMPILE_WAIT_S = 5.0     # how long admission waits for a new constraint's tables
MAX_REGEX_CHARS = 20_000        # longer regexes go straight to the host path


class DeviceCompiler:
    def __init__(self, vocab_fn: Any, limits: AutomatonLimits = AutomatonLimits(),
                 cache_size: int = 64) -> None:
        """vocab_fn: () -> TokenVocabulary (built on first use: ~0.1 s for 50k tokens)."""
        self._vocab_fn = vocab_fn
        self._vocab: TokenVocabulary | None = None
        self.limits = limits
        self.cache_size = cache_size
        self._cache: OrderedDict[str, AutomatonTables | NotOnDevice] = OrderedDict()
        self._jobs: dict[str, Future] = {}          # regex -> compile in flight
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="device-automaton")
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

    def compile(self, so: Any, wait_s: float | None = None) -> tuple[str, AutomatonTables]:
        """(key, tables) for a StructuredOutputsParams; NotOnDevice if it must take the
        host path (also when its compile takes longer than wait_s; None: no limit)."""
        regex = device_regex(so)
        if len(regex) > MAX_REGEX_CHARS:
            raise NotOnDevice(f"regex of {len(regex)} characters > {MAX_REGEX_CHARS}")
        with self._lock:
            hit = self._cache.get(regex)
            if hit is not None:
                self._cache.move_to_end(regex)
            else:
                job = self._jobs.get(regex)
                if job is None:
                    job = self._jobs[regex] = self._pool.submit(self._build, regex)
        if hit is None:
            try:
                hit = job.result(timeout=wait_s)
            except FutureTimeout:
                raise NotOnDevice(f"still compiling after {wait_s:g} s") from None
        if isinstance(hit, NotOnDevice):
            raise hit
        return regex, hit

    def _build(self, regex: str) -> AutomatonTables | NotOnDevice:
        t0 = time.perf_counter()
        try:
            out: AutomatonTables | NotOnDevice = compile_tables(regex, self.vocab, self.limits)
        except NotOnDevice as e:
            out = e
        except Exception as e:   # noqa: BLE001 - the host path reports the real error
            out = NotOnDevice(f"device compile failed: {type(e).__name__}: {e}")
        with self._lock:
            self.compile_seconds[regex] = time.perf_counter() - t0
            self._cache[regex] = out
            self._jobs.pop(regex, None)
            while len(self._cache) > self.cache_size:
                old, _ = self._cache.popitem(last=False)
                self.compile_seconds.pop(old, None)
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DeviceStructured:
    """The engine's side of the device path: compile a request's constraint and
    reserve its tables in the runner's pool (structured/device_pool.DeviceAutomata).

    admit() -> True: the constraint runs on the device (the runner starts the slot
    when the request is scheduled, and releases it when the request finishes);
    False: not constrained, or it must take the host path (not regular, over the size
    limits, or the pool is full)."""

    def __init__(self, compiler: DeviceCompiler, automata: Any,
                 wait_s: float = DEVICE_COMPILE_WAIT_S) -> None:
        self.compiler = compiler
        self.automata = automata
        self.wait_s = wait_s
        self.last_fallback: str | None = None       # why the last request went to the host

    def admit(self, request: Any) -> bool:
        so = getattr(request.sampling_params, "structured_outputs", None)
        if so is None:
            return False
        try:
            key, tables = self.compiler.compile(so, wait_s=self.wait_s)
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
