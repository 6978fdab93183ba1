"""RequestGrammar: one sequence's grammar state, from compile to finish.

    WAITING_FOR_FSM  job running (backend.py)  --ready()--> matcher built
    reasoning        (a request with a reasoning end, reasoning_end.py) until the end
                     sequence is kept: no mask, the matcher stays at its initial state
    matcher          accept(token) on every answer token the request keeps (scheduler update)
                     rollback_to(n) when fewer tokens are kept (preemption, rejected
                     speculative tokens)
                     terminated(): the grammar admits no further token but EOS

The scheduler fills the rows of the step's token bitmask from the matchers of the rows
that sample (fill_bitmasks); the sampler applies it (sampling/bitmask.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from llguidance import LLMatcher

from jaxserve.structured.backend import CompileJob, GrammarBackend, GrammarError, words_per_row
from jaxserve.structured.reasoning_end import ReasoningWatch


@dataclass(slots=True)
class RequestGrammar:
    job: CompileJob
    matcher: LLMatcher | None = None
    num_accepted: int = 0
    error: str | None = None
    # a reasoning model's request: no mask and no matcher moves until its reasoning ends
    watch: ReasoningWatch = field(default_factory=ReasoningWatch)

    def ready(self, backend: GrammarBackend, now: float | None = None) -> bool:
        """True once compiled (or failed: see error); False while compiling. A compile
        past the backend's timeout fails this request."""
        if self.matcher is not None or self.error is not None:
            return True
        now = time.monotonic() if now is None else now
        if self.job.timed_out(now, backend.compile_timeout_s):
            self.error = str(backend.fail_slow(self.job))
            return True
        if not self.job.done():
            return False
        try:
            self.matcher = self.job.result().new_matcher()
        except GrammarError as e:
            self.error = str(e)
        except Exception as e:      # noqa: BLE001 - a library failure fails this request
            self.error = f"compiling the constraint failed: {type(e).__name__}: {e}"
        return True

    def accept(self, token: int) -> bool:
        """Advance on a kept token; False if the grammar rejects it."""
        assert self.matcher is not None
        ok = self.matcher.consume_token(token)
        if ok:
            self.num_accepted += 1
        return ok

    def rollback_to(self, num_tokens: int) -> None:
        """Forget the tokens after the first num_tokens accepted ones."""
        assert self.matcher is not None
        extra = self.num_accepted - num_tokens
        if extra > 0:
            self.matcher.rollback(extra)
            self.num_accepted = num_tokens

    def terminated(self) -> bool:
        """Nothing but EOS may follow: the request is complete."""
        return self.matcher is not None and self.matcher.is_stopped()

    def rejection(self) -> str:
        err = self.matcher.get_error() if self.matcher is not None else ""
        return f"the grammar rejected a generated token ({err.strip()[:300]})"


def fill_bitmasks(backend: GrammarBackend, grammars: list[RequestGrammar]) -> np.ndarray:
    """[len(grammars), W] int32: each grammar's allowed next tokens (bit j of word w:
    token 32w + j), filled in parallel by llguidance's executor."""
    out = np.empty((len(grammars), words_per_row(backend.vocab_size)), np.int32)
    pairs = [(g.matcher, i) for i, g in enumerate(grammars)]
    backend.executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, out.shape[1] * 4,
                                             len(grammars))
    return out

