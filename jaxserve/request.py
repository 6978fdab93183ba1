"""Host-side request state and the user-facing outputs (vLLM-shaped)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_FSM = "waiting_for_fsm"   # its grammar compiles (structured outputs)
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the model length
    ABORT = "abort"        # cancelled (client gone, shutdown)
    ERROR = "error"        # failed with a reason (see Request.error)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache


@dataclass(slots=True)
class Request:
    """One sequence being generated. Owned by the scheduler; the KV cache manager
    owns its blocks (looked up by request_id)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    prompt: str | None = None
    # the LoRA adapter this request runs with (jaxserve/lora.py's Adapter, loaded before
    # the request reaches the engine), or None: the base model
    lora: Any = None
    lora_name: str | None = None      # the name the request gave for it (metrics)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    # Sampler state carried with the request (seeded RNG is keyed by position).
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 0

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # a pooling request's (SamplingParams.pooled) pooled final hidden state, float32 [D],
    # on its finished output (model/pooling.py finishes it into an embedding)
    pooled: Any = None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"outputs={self.outputs!r}, finished={self.finished})")
