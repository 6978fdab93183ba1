"""The grammar backend: compile constraints for one tokenizer, asynchronously, cached.

    backend = GrammarBackend(hf_tokenizer, vocab_size=V, eos_token_ids=(2,))
    job = backend.submit(params.structured_outputs)    # returns at once (thread pool)
    job.done() / job.result() -> CompiledGrammar        # GrammarError if it failed
    matcher = compiled.new_matcher()                    # one per sequence (matcher.py)

A compile checks the constraint (grammar.py), then builds llguidance's matcher for the
tokenizer (the grammar, then one mask so that the lexer's first states exist) in a small
thread pool; llguidance releases the GIL while it builds, so the engine thread keeps
stepping, and takes only the constraint's canonical text itself. Compiled grammars are cached by
their canonical source (n samples of one request, or the same schema sent again, compile
once); a sequence's matcher is a copy of the compiled one's initial state.

Bounds: the source size and llguidance's limits (grammar.py), and COMPILE_TIMEOUT_S of
wall time: a compile still running after it fails its request (the scheduler checks,
scheduler.py); the result, when it comes, is remembered as failed, so the same grammar
fails fast next time. Failures are cached the same way.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from jaxserve.model.tokenizer.load import resolved
from jaxserve.sampling.params import SamplingParamsError, StructuredOutputsParams
from jaxserve.structured.grammar import (GrammarSource, checked_source, parser_limits,
                                         source_text)

log = logging.getLogger("jaxserve")

COMPILE_TIMEOUT_S = 10.0
COMPILE_THREADS = 2
CACHE_SIZE = 128


class GrammarError(ValueError):
    """A constraint that cannot be compiled (too complex, too slow, or invalid)."""


def words_per_row(vocab_size: int) -> int:
    """W: int32 words of one row of the token bitmask (bit j of word w: token 32w + j)."""
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class CompiledGrammar:
    source: GrammarSource
    template: LLMatcher          # at its initial state; copied for every sequence
    seconds: float               # compile wall time

    def new_matcher(self) -> LLMatcher:
        return self.template.deep_copy()


@dataclass(slots=True)
class CompileJob:
    """A compile in flight (or done); shared by every request with the same grammar."""
    key: str
    future: Future
    started: float = field(default_factory=time.monotonic)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> CompiledGrammar:
        """The compiled grammar; GrammarError if the compile failed."""
        return self.future.result()

    def timed_out(self, now: float, timeout: float) -> bool:
        return not self.future.done() and now - self.started > timeout


class GrammarBackend:
    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 threads: int = COMPILE_THREADS) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._hf = tokenizer
        self._eos = list(eos_token_ids) or None
        self._tok: LLTokenizer | None = None       # built on first use (~0.2-1 s)
        self._tok_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._jobs: OrderedDict[str, CompileJob] = OrderedDict()
        self.executor = LLExecutor(num_threads=threads)   # parallel mask fills

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        with self._tok_lock:
            if self._tok is None:
                # imported here: llguidance.hf imports transformers, which `jaxserve serve`
                # imports on the thread that loads the tokenizer while the engine compiles
                # (its lazy module is not safe to import from two threads at once)
                from llguidance.hf import from_tokenizer
                self._tok = from_tokenizer(resolved(self._hf), n_vocab=self.vocab_size,
                                           eos_token=self._eos)
            return self._tok

    def submit(self, params: StructuredOutputsParams) -> CompileJob:
        """Start compiling (or reuse the cached compile). Only the constraint's canonical
        text is taken here (the engine thread calls this); checking and compiling it run
        in the pool. SamplingParamsError for a schema that is not JSON."""
        kind, text = source_text(params)
        key = f"{kind}:{text}"
        job = self._jobs.get(key)
        if job is not None:
            self._jobs.move_to_end(key)
            return job
        job = CompileJob(key, self._pool.submit(self._compile, kind, text))
        self._jobs[key] = job
        while len(self._jobs) > CACHE_SIZE:
            self._jobs.popitem(last=False)
        return job

    def _compile(self, kind: str, text: str) -> CompiledGrammar:
        t0 = time.perf_counter()
        try:
            src = checked_source(kind, text)
        except SamplingParamsError as e:
            raise GrammarError(str(e)) from None
        m = LLMatcher(self.ll_tokenizer, src.grammar, log_level=0, limits=parser_limits())
        if not m.is_error():
            # The first mask builds the lexer's first states: here, not in a step.
            mask = np.empty(words_per_row(self.vocab_size), np.int32)
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            m.reset()
        if m.is_error():
            raise GrammarError(f"the {src.kind} constraint cannot be compiled: "
                               f"{m.get_error().strip()[:500]}")
        secs = time.perf_counter() - t0
        log.debug("grammar %s compiled in %.3f s", src.kind, secs)
        return CompiledGrammar(src, m, secs)

    def fail_slow(self, job: CompileJob) -> GrammarError:
        """The error of a compile that ran past the timeout; its key is remembered as
        failed so a resend fails at once."""
        err = GrammarError(f"compiling the constraint took longer than "
                           f"{self.compile_timeout_s:g} s (too complex)")
        failed: Future = Future()
        failed.set_exception(err)
        self._jobs[job.key] = CompileJob(job.key, failed)
        return err

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
