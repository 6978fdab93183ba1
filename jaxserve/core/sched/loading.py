"""Requests whose prompt KV is filled from outside the step: pulled from another engine
(KV transfer, kv_transfer/connector.py) or read back from an offload tier
(kv_transfer/offload.py).

Such a request gets fresh blocks (unhashed, like any block being filled) for the tokens
that arrive from outside. From the host tier the engine writes them before this very
step, so the request runs at once with those tokens computed. A remote pull or a disk
read takes longer: the request then waits in `requests` here, off the waiting queue and
holding its blocks, so the requests behind it go on; the engine reports the end of each
load (Scheduler.finish_loading). The fresh blocks all loads hold together are capped
(`max_blocks`), so slow or failing loads never take the pool from local requests.
"""
from __future__ import annotations

from typing import Any

from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.request import Request


class KVLoads:
    def __init__(self, kv: KVCacheManager, *, connector: Any = None, offload: Any = None,
                 max_blocks: int | None = None) -> None:
        self.kv = kv
        self.connector: Any = connector
        self.offload: Any = offload
        self.max_blocks = max_blocks
        self.requests: dict[str, Request] = {}      # loading, off the queue
        self.blocks: dict[str, int] = {}            # req_id -> fresh blocks it holds

    def _room(self, fresh: int) -> bool:
        return self.max_blocks is None or sum(self.blocks.values()) + fresh <= self.max_blocks

    def _hold(self, request: Request, block_ids: list[int]) -> None:
        self.requests[request.request_id] = request
        self.blocks[request.request_id] = len(block_ids)

    def start_remote(self, request: Request, hits: list, num_local: int) -> bool | None:
        """Allocate blocks for the prompt KV another engine holds for this request and
        start pulling it. -> True (it now waits here: the caller takes it off the
        queue), False (nothing to pull), None (no room for its blocks now)."""
        n_ext = self.connector.num_external_tokens(request, num_local)
        if n_ext <= 0:
            self.connector.release_remote(request)
            return False
        fresh = self.kv.num_blocks_for(len(hits) * self.kv.block_size + n_ext) - len(hits)
        if not self._room(fresh):
            self.connector.release_remote(request)      # computed here instead
            return False
        block_ids = self.kv.allocate_external(request, hits, n_ext)
        if block_ids is None:
            return None
        self._hold(request, block_ids)
        self.connector.start_load(request, block_ids, num_local)
        return True

    def start_offload(self, request: Request, hits: list) -> int | None:
        """Fresh blocks for the prefix blocks past the device hits that an offload tier
        holds. -> 0 (none), 1 (from host memory: computed now), -1 (read from disk: it
        now waits here, the caller takes it off the queue), None (no room now)."""
        hashes = self.kv.prefix_hashes(request, len(hits))
        n = self.offload.lookup(hashes) if hashes else 0
        if n == 0 or not self._room(n):
            return 0                        # nothing held, or computed here instead
        bs = self.kv.block_size
        num_local = len(hits) * bs
        block_ids = self.kv.allocate_external(request, hits, n * bs)
        if block_ids is None:
            return None
        if self.offload.start_load(request.request_id, hashes[:n], block_ids, num_local):
            request.num_computed_tokens = num_local + n * bs
            return 1
        self._hold(request, block_ids)
        return -1

    def pop(self, req_id: str) -> Request | None:
        """Stop tracking a load (it ended, or its request finished)."""
        self.blocks.pop(req_id, None)
        return self.requests.pop(req_id, None)
