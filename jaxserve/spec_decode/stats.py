"""Speculative decoding counters (vLLM's spec_decode metrics, cumulative).

    acceptance rate      = accepted tokens / draft tokens
    mean accepted length = 1 + accepted tokens / drafts   (tokens a speculating row
                           emits per step, the bonus or correction token included)
    per-position         = accepted_per_pos[i] / drafts: how often proposal i+1 is taken
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    num_spec_tokens: int = 0           # k (the width of accepted_per_pos)
    num_drafts: int = 0                # request rows that speculated, over all steps
    num_draft_tokens: int = 0          # tokens proposed (and verified)
    num_accepted_tokens: int = 0       # of those, accepted
    num_spec_steps: int = 0            # steps with at least one speculating row
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.accepted_per_pos) < self.num_spec_tokens:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position_rate(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_spec_steps": self.num_spec_steps,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "accepted_per_pos": list(self.accepted_per_pos)}
