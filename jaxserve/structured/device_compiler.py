"""Structured-outputs constraint -> device automaton tables, cached.

    compiler = DeviceCompiler.for_tokenizer(tokenizer, eos_ids, vocab_size)
    key, tables = compiler.compile(sampling_params.structured_outputs, wait_s=5.0)

The key is the constraint's regex: requests with the same schema / regex / choice
share one compiled table (and one copy in the device pool). All analysis of the user's
constraint (schema -> regex, regex -> DFA -> tables) runs in a child process
(compile_worker.py) driven by one pool thread, under a deadline and a memory cap: the
engine thread only looks up caches and futures. The caller waits at most wait_s, then
gets NotOnDevice (the host path takes that request) while the compile finishes in the
background for the requests that come later. A constraint that cannot run on the device
(json_object, grammar, recursive schema, over the size limits or the deadline) is
remembered too, so the next such request does not try again.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from jaxserve.model.tokenizer.load import resolved
from jaxserve.structured.compile_worker import CompileWorker
from jaxserve.structured.device_automaton import (AutomatonLimits, AutomatonTables,
                                                  NotOnDevice, constraint_source)
from jaxserve.structured.device_vocab import TokenVocabulary
from jaxserve.structured.reasoning_end import end_of

DEVICE_COMPILE_WAIT_S = 5.0     # how long admission waits for a new constraint's tables
DEVICE_COMPILE_DEADLINE_S = 20.0   # each phase of one compile; then its child is killed
QUEUED_GRACE_S = 0.5            # a compile not started by then is queued behind another
MAX_REGEX_CHARS = 20_000        # longer regexes go straight to the host path

Built = tuple[str, "AutomatonTables | NotOnDevice"]     # (regex or "", tables or why not)


class DeviceCompiler:
    def __init__(self, vocab_fn: Any, limits: AutomatonLimits = AutomatonLimits(),
                 cache_size: int = 64, deadline_s: float = DEVICE_COMPILE_DEADLINE_S) -> None:
        """vocab_fn: () -> TokenVocabulary (built on first use: ~0.1 s for 50k tokens)."""
        self._vocab_fn = vocab_fn
        self._vocab: TokenVocabulary | None = None
        self.limits = limits
        self.cache_size = cache_size
        self.deadline_s = deadline_s
        self._cache: OrderedDict[tuple[str, str], Built] = OrderedDict()   # by source
        self._tables: OrderedDict[str, AutomatonTables] = OrderedDict()    # by regex
        self._jobs: dict[tuple[str, str], Future] = {}       # source -> compile in flight
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="device-automaton")
        self._worker: CompileWorker | None = None
        self.compile_seconds: dict[str, float] = {}     # regex -> seconds (last compiles)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, eos_token_ids: tuple[int, ...], vocab_size: int,
                      **kw: Any) -> "DeviceCompiler":
        return cls(lambda: TokenVocabulary.from_tokenizer(
            resolved(tokenizer), eos_token_ids, vocab_size), **kw)

    @property
    def vocab(self) -> TokenVocabulary:
        with self._lock:
            if self._vocab is None:
                self._vocab = self._vocab_fn()
            return self._vocab

    @property
    def worker(self) -> CompileWorker:
        """The compile child process (started on first compile)."""
        if self._worker is None:
            self._worker = CompileWorker(self.vocab, self.limits)
        return self._worker

    def compile(self, so: Any, wait_s: float | None = None) -> tuple[str, AutomatonTables]:
        """(key, tables) for a StructuredOutputsParams; NotOnDevice if it must take the
        host path (also when its compile takes longer than wait_s; None: no limit)."""
        job = self.submit(so)
        try:
            key, tables = job.result(timeout=wait_s)
        except FutureTimeout:
            raise NotOnDevice(f"still compiling after {wait_s:g} s") from None
        if isinstance(tables, NotOnDevice):
            raise tables
        return key, tables

    def submit(self, so: Any) -> Future:
        """Start (or reuse) the compile of a constraint without waiting: a future of
        (key, AutomatonTables | NotOnDevice). NotOnDevice at once if it is not regular."""
        source = constraint_source(so)
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                done: Future = Future()
                done.set_result(hit)
                return done
            job = self._jobs.get(source)
            if job is None:
                job = self._jobs[source] = self._pool.submit(self._build, source)
            return job

    def _build(self, source: tuple[str, str]) -> Built:
        t0 = time.perf_counter()
        regex = ""
        try:
            regex = self.worker.regex(*source, deadline_s=self.deadline_s)
            if len(regex) > MAX_REGEX_CHARS:
                raise NotOnDevice(f"regex of {len(regex)} characters > {MAX_REGEX_CHARS}")
            with self._lock:
                tables = self._tables.get(regex)
            out: Built = (regex, tables if tables is not None
                          else self.worker.tables(regex, deadline_s=self.deadline_s))
        except NotOnDevice as e:
            out = (regex, e)
        except Exception as e:   # noqa: BLE001 - the host path reports the real error
            out = (regex, NotOnDevice(f"device compile failed: {type(e).__name__}: {e}"))
        with self._lock:
            self.compile_seconds[regex] = time.perf_counter() - t0
            self._cache[source] = out
            if isinstance(out[1], AutomatonTables):
                self._tables[regex] = out[1]
            self._jobs.pop(source, None)
            for cache in (self._cache, self._tables):
                while len(cache) > self.cache_size:
                    cache.popitem(last=False)
            while len(self.compile_seconds) > self.cache_size:
                self.compile_seconds.pop(next(iter(self.compile_seconds)))
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()


class DeviceStructured:
    """The engine's side of the device path: compile a request's constraint and
    reserve its tables in the runner's pool (structured/device_pool.DeviceAutomata).

    With the host path's grammar gate (structured/scheduling.py), asynchronously:
    start() when the request arrives (its host grammar compiles at the same time, the
    request waits in WAITING_FOR_FSM), decide() when the gate would release it: True,
    its tables are in the pool and it runs on the device (no host matcher); False, the
    host path keeps it (not regular, over the size limits, pool full, or the device
    compile still running wait_s after the request arrived); None, not yet.
    admit() is the same decision at once (waiting up to wait_s), for an engine without
    the gate. Either way the runner starts the slot when the request is scheduled and
    releases the tables when it finishes."""

    def __init__(self, compiler: DeviceCompiler, automata: Any,
                 wait_s: float = DEVICE_COMPILE_WAIT_S) -> None:
        self.compiler = compiler
        self.automata = automata
        self.wait_s = wait_s
        self.queued_grace_s = QUEUED_GRACE_S
        self.last_fallback: str | None = None       # why the last request went to the host
        self._pending: dict[str, tuple[Future, float]] = {}   # rid -> job, arrival

    def start(self, request: Any, now: float | None = None) -> None:
        so = getattr(request.sampling_params, "structured_outputs", None)
        if so is None:
            return
        try:
            job = self.compiler.submit(so)
        except NotOnDevice as e:
            self.last_fallback = str(e)
            return
        self._pending[request.request_id] = (job, time.monotonic() if now is None else now)

    def decide(self, request: Any, now: float) -> bool | None:
        rid = request.request_id
        entry = self._pending.get(rid)
        if entry is None:
            return False
        job, started = entry
        if not job.done():
            waited = now - started
            # (done by now counts as running: it finished after the first look)
            if waited < self.wait_s and (job.running() or job.done()
                                         or waited < self.queued_grace_s):
                return None
            # past wait_s, or queued behind another constraint's compile: a request
            # never waits for someone else's constraint
            self.last_fallback = (f"still compiling after {self.wait_s:g} s"
                                  if waited >= self.wait_s else
                                  "the device compiler is busy with another constraint")
            del self._pending[rid]
            return False
        del self._pending[rid]
        return self._attach(request, *job.result())

    def futures(self) -> list[Future]:
        """Device compiles requests are waiting for (the idle engine waits on them)."""
        return [job for job, _ in self._pending.values() if not job.done()]

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def admit(self, request: Any) -> bool:
        so = getattr(request.sampling_params, "structured_outputs", None)
        if so is None:
            return False
        try:
            key, tables = self.compiler.compile(so, wait_s=self.wait_s)
        except NotOnDevice as e:
            self.last_fallback = str(e)
            return False
        return self._attach(request, key, tables)

    def _attach(self, request: Any, key: str, tables: AutomatonTables | NotOnDevice) -> bool:
        if isinstance(tables, NotOnDevice):
            self.last_fallback = str(tables)
            return False
        end = end_of(request.sampling_params.structured_outputs)
        if not self.automata.attach(request.request_id, key, tables, end):
            self.last_fallback = "the device automaton pool is full"
            return False
        return True

    def release(self, req_id: str) -> None:
        """A request admitted here never reached the runner (refused after admit)."""
        self.automata.detach(req_id)
