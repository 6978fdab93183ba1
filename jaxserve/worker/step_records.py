"""What the model runner keeps per request and per step: a request's cached state (its
tokens, blocks and slot, the host side of what the device holds for it), the record of a
dispatched step until collect() takes its tokens, and the result collect() returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.sampling.params import SamplingParams
from jaxserve.worker import pooling as pool_rows
from jaxserve.worker.step_inputs import StepBatch


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int
    slot: int                     # persistent row in the block table / sampler state
    # sampled by earlier steps, not on the host yet: the scheduler's count, as of the
    # step being dispatched (SchedulerOutput.num_pending)
    num_pending: int = 0
    # prompt logprob entries so far (positions 1..), handed over with the first sampled
    # token; None: not wanted, or already handed over
    prompt_logprobs: list | None = None
    # a pooling request's running sum (worker/pooling.py); None: it generates
    pool: pool_rows.PoolAccumulator | None = None
    lora: Any = None              # its LoRA adapter (jaxserve/lora.py), or None: the base
    lora_slot: int = 0            # the adapter's device slot this step (0: the base)

    @property
    def output_len(self) -> int:
        """Output tokens so far, pending ones included (the next token's position)."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, list[int]]                 # req_id -> new token ids
    logprobs: dict[str, Any]                      # req_id -> sampler logprob rows (host)
    host_seconds: float                           # batch building + token handling
    device_seconds: float                         # launch until results were on host
    wait_seconds: float = 0.0                     # of which blocked in collect()
    launch_seconds: float = 0.0                   # in the step call (dispatch; on CPU it
                                                  # also waits for the previous step's
                                                  # donated buffers)
    # req_id -> the request's prompt logprob entries for positions 1.. (once, with its
    # first sampled token)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    # req_id -> a pooling request's pooled vector [D] float32 (with its one token)
    pooled: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(slots=True)
class InflightStep:
    """A dispatched step whose results have not been collected yet."""
    so: SchedulerOutput
    batch: StepBatch
    row_states: list[CachedRequestState]          # each row's state when dispatched
    out: Any                                      # device arrays (sampled tokens, logprobs)
    t_start: float                                # dispatch() called
    t_launch: float                               # batch built, step launched
    t_launched: float = 0.0                       # the step call returned
    prompt: Any = None                            # (prompt-logprob outputs, PromptRows list)
    pooled: Any = None                            # (pooled row sums, PoolRows list)
