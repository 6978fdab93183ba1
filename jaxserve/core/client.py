"""EngineClient: the one interface the front ends (LLM, AsyncEngine, server, bench) use.

    EngineCore            one replica: scheduler + KV cache + runner
    DataParallelEngine    several EngineCores behind one front (sums their snapshots)

Front ends never reach into `scheduler` or `kv_manager`: those exist on EngineCore
only, so code that did worked with one replica and failed at start with several (the
untyped `core: Any` let it through). Everything a front end needs is a method here, and
mypy (tests/tools/test_typecheck.py) checks that both engines implement all of it.

None of these methods is thread-safe: call them from the thread that steps the engine
(AsyncEngine's engine thread, or the LLM caller).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jaxserve.core.engine_core import EngineCoreOutput, EngineStats
    from jaxserve.request import FinishReason, Request


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """Gauges and counters of an engine at one moment (for /metrics and /admin)."""
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_blocks: int = 0                 # KV blocks in the pool(s)
    num_free_blocks: int = 0
    prefix_queries: int = 0             # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0                # ... and found there
    num_compiles: int = 0
    steps: int = 0
    # speculative decoding (spec_decode/stats.py): drafts = rows that speculated
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()   # accepted proposals at position i
    # KV offload tiers (kv_transfer/offload.py): prompt tokens looked up past the
    # previous tier's hits / found there; bytes moved each way; bytes held now
    offload_host_queries: int = 0
    offload_host_hits: int = 0
    offload_disk_queries: int = 0
    offload_disk_hits: int = 0
    offload_bytes_to_host: int = 0      # device -> host
    offload_bytes_to_device: int = 0    # host -> device
    offload_bytes_to_disk: int = 0
    offload_bytes_from_disk: int = 0
    offload_host_bytes: int = 0
    offload_disk_bytes: int = 0
    # LoRA adapters (names) of the running and the waiting requests
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, over all replicas (0..1)."""
        used = self.num_blocks - self.num_free_blocks
        return used / self.num_blocks if self.num_blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["kv_usage"] = self.kv_usage
        return d

    @staticmethod
    def total(parts: Sequence[EngineSnapshot], *, steps: int) -> EngineSnapshot:
        """Sum of replica snapshots; `steps` is the front's own count (replicas step
        together, so their counts are not added up)."""
        sums: dict[str, Any] = {f.name: sum(getattr(p, f.name) for p in parts)
                                for f in fields(EngineSnapshot)
                                if f.name not in ("spec_accepted_per_pos",
                                                  "running_loras", "waiting_loras")}
        for name in ("running_loras", "waiting_loras"):
            sums[name] = tuple(sorted({a for p in parts for a in getattr(p, name)}))
        width = max((len(p.spec_accepted_per_pos) for p in parts), default=0)
        sums["spec_accepted_per_pos"] = tuple(
            sum(p.spec_accepted_per_pos[i] for p in parts if i < len(p.spec_accepted_per_pos))
            for i in range(width))
        sums["steps"] = steps
        return EngineSnapshot(**sums)


@runtime_checkable
class EngineClient(Protocol):
    """What EngineCore and DataParallelEngine both provide (see the module docstring)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def model_cfg(self) -> Any: ...

    @property
    def warmup_seconds(self) -> float: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def num_compiles(self) -> int: ...

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (user-facing message) if it can never fit."""

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Finish requests as aborted and free their KV blocks; unknown ids are ignored."""

    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> None:
        """Finish requests the front end decided are done (stop strings)."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; the requests that got tokens or finished."""

    def snapshot(self) -> EngineSnapshot: ...

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes; False if some blocks are in use (nothing dropped there)."""

    def kv_transfer_params(self, transfer_id: str) -> dict[str, Any] | None:
        """Where a decode server pulls the prefill saved under transfer_id (a prefill
        response's kv_transfer_params); None when nothing was saved (kv_transfer/)."""

    def shutdown(self) -> None:
        """Release threads and other resources; the engine is unusable afterwards."""
