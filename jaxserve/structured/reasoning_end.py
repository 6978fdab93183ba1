"""A constraint that starts after a reasoning model's reasoning.

A reasoning model writes its thinking first (`<think> ... </think>`), then its answer;
a JSON schema or a tool call constrains the answer, not the thinking. A request whose
StructuredOutputsParams carry `reasoning_end` (the token ids of `</think>`; the server
sets them, server/reasoning.py) samples freely until its output contains that sequence,
and its constraint holds from the token after the sequence's first occurrence, from the
grammar's initial state. Without the sequence in the output, the whole output is free.

Both structured paths follow the same rule, with the helpers here:

    host path     structured/scheduling.py: while reasoning, the row gets no bitmask
                  row and its matcher does not move (ReasoningWatch per request)
    device path   structured/device_pool.py: the slot's automaton state is parked while
                  the step watches its last tokens for the end sequence on the device
                  (so asynchronous scheduling and multi-step decode switch at the exact
                  token); a restart replays the kept outputs with answer_start()
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def end_of(so: Any) -> tuple[int, ...]:
    """The reasoning end sequence of a StructuredOutputsParams; () when the constraint
    holds from the first token."""
    end = getattr(so, "reasoning_end", None) if so is not None else None
    return tuple(end) if end else ()


def answer_start(tokens: Sequence[int], end: tuple[int, ...]) -> int | None:
    """Index in `tokens` (a request's output) of its first constrained token: 0 without
    an end sequence, just after the end sequence's first occurrence, or None while the
    output does not contain it (still reasoning)."""
    if not end:
        return 0
    n = len(end)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i:i + n]) == end:
            return i + n
    return None


@dataclass(slots=True)
class ReasoningWatch:
    """One host-path request's phase: reasoning (answer_from None) or answering from
    output index answer_from."""
    end: tuple[int, ...] = ()
    answer_from: int | None = 0

    @classmethod
    def of(cls, so: Any) -> "ReasoningWatch":
        end = end_of(so)
        return cls(end, None if end else 0)

    @property
    def reasoning(self) -> bool:
        return self.answer_from is None

    def observe(self, output: Sequence[int]) -> None:
        """The request kept a reasoning token (the last of `output`): the answer starts
        after it if it completes the end sequence."""
        n = len(self.end)
        if len(output) >= n and tuple(output[-n:]) == self.end:
            self.answer_from = len(output)

    def kept(self, num_output: int) -> int:
        """The request keeps only its first num_output tokens (preemption): how many
        answer tokens its matcher keeps (0, and reasoning again, if the end goes)."""
        if self.answer_from is None:
            return 0
        if num_output < self.answer_from:
            self.answer_from = None
            return 0
        return num_output - self.answer_from
