"""SchedulerOutput: what one step runs, as a diff against what the runner already knows.

The runner keeps a state per request it has seen (token ids, block-table row). Each
step it receives:
  * scheduled_new_reqs: requests it has never seen, or that come back after preemption
    (their old state was dropped): full token ids and block ids;
  * scheduled_cached_reqs: requests it knows, with only the blocks appended since the
    last step (the tokens they sample are appended by the runner itself);
  * finished_req_ids / preempted_req_ids: states to drop before this step runs.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from jaxserve.sampling.params import SamplingParams


class StepKind(enum.Enum):
    """What a scheduled step is: the scheduler sets it, the runner and the engine read
    it instead of inferring it from the rows."""
    MIXED = "mixed"                 # prefill chunks and single decode tokens
    MULTI_STEP_DECODE = "multi"     # decode rows only, num_steps > 1 on the device
    VERIFY = "verify"               # some rows carry proposals to verify


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]              # prompt + any output so far (after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]              # all blocks of the request so far
    num_computed_tokens: int          # tokens already in the KV cache (prefix hits)
    eos_token_ids: tuple[int, ...] = ()   # the request's EOS ids (min_tokens masks them)
    lora: Any = None                  # its LoRA adapter (jaxserve/lora.py Adapter) or None


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]          # blocks appended since the last step
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]        # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # rows that reach the end of their tokens this step and sample one (the scheduler
    # counts it as a pending output token until update_from_output brings it)
    sampling_req_ids: set[str] = field(default_factory=set)
    # req_id -> tokens proposed for it (speculative decoding; vLLM's name): they follow
    # its last token in this step and are verified there
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> its token bitmask row (structured outputs: W int32 words as bytes, bit j
    # of word w allows token 32w + j) for the constrained rows that sample this step
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    # decode steps run back to back on the device this step (multi-step decode): > 1
    # only when every row is a decode row; each then computes k_r <= num_steps tokens
    # (its num_scheduled_tokens; fewer near its length limit) and samples k_r tokens,
    # each fed from the one before
    num_steps: int = 1
    kind: StepKind = StepKind.MIXED
    # req_id -> tokens earlier steps sampled for the row that are not appended yet
    # (asynchronous scheduling; absent: none). The scheduler alone counts them; the
    # runner reads them here
    num_pending: dict[str, int] = field(default_factory=dict)

    def tokens_sampled(self, req_id: str) -> int:
        """Tokens a sampling row samples this step: one, or in a multi-step decode step
        one per token it computes (k_r)."""
        if self.kind is StepKind.MULTI_STEP_DECODE:
            return self.num_scheduled_tokens[req_id]
        return 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
