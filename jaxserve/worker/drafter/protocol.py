"""The contract between the model runner and a device drafter.

A drafter proposes and keeps its own state (a draft model's KV pool); it never writes
the scheduler's output or the runner's state. What a proposal changes on the runner's
side (the proposed values, the target's KV for a drafter that shares it, the
proposals' distribution the verification reads) comes back in `Proposals`, and the
runner applies it itself (ModelRunner.apply_proposals).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from jaxserve.core.sched.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class Proposals:
    # req_id -> the proposed token ids, one per slot the scheduler gave the row
    tokens: dict[str, list[int]]
    # the runner's KV cache after the draft steps (a drafter running the target's own
    # first layers writes them), or None: the runner's KV is unchanged
    kv: Any
    # the proposals' distribution q for the step state (the verification reads it)
    draft_probs: Any


class Drafter(Protocol):
    def initial_draft_probs(self) -> Any:
        """The step state's draft_probs before any proposal (every slot, zeros)."""

    def propose(self, so: SchedulerOutput) -> Proposals:
        """Values for the step's proposal slots (so.scheduled_spec_decode_tokens),
        after the runner took the step's diff and before its step counter moves."""

    def mirror(self, packed: Any, sampler_state: Any) -> None:
        """Keep the drafter's own state (its KV) in step with the target's step."""

    def compile_propose(self) -> None:
        """Compile the proposal programs at warm-up."""

    def compile_mirror(self, packed: Any, sampler_state: Any) -> None:
        """Compile the mirror program for one target step shape."""
