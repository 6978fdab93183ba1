"""KVConnector: disaggregated prefill/decode with vLLM's split of duties.

Scheduler side (host decisions, called by scheduler/scheduler.py on the engine thread):
  * num_external_tokens(request, num_local)   how many of a request's prompt tokens a
                                              remote prefill holds beyond the local
                                              prefix hits (0: none, compute as usual)
  * start_load(request, block_ids, first)     pull them into these (fresh) blocks; the
                                              request waits off the queue meanwhile
  * request_finished(request, block_ids)      a producer's prefill finished: save it
Worker side (device arrays, called by engine/core.py on the engine thread):
  * save_pending(kv)                          read the saved prefills' blocks out
                                              (jitted gather) before their blocks can
                                              be reused by the next step
  * finished_loads() / write(kv, load)        loads whose bytes arrived (or failed);
                                              write them in (jitted scatter)

A request's life on the two servers (the router drives it; docs/serving.md):

  prefill server  prompt, max_tokens=1, kv_transfer_params {do_remote_decode}
                  -> finished: blocks read out into the SavedStore (bounded, ttl), its
                     blocks freed at once; the response advertises {do_remote_prefill,
                     remote_host, remote_port, transfer_id}
  decode server   the original request + those kv_transfer_params
                  -> local prefix hits h; blocks for tokens [h, P-1) allocated (not yet
                     hashed), pulled on a thread, scattered in; then the request joins
                     the queue with P-1 tokens computed and computes the last prompt
                     token itself (so it samples every output token, seeded or not)
                  -> a failed or timed-out pull frees those blocks and recomputes

Blocks are the KV manager's to give and free; nothing here writes a block table.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.kv_transfer.blocks import BlockMover
from jaxserve.kv_transfer.config import KVTransferConfig
from jaxserve.kv_transfer.transport import (SavedStore, TransferError, TransferServer,
                                            fetch, token_digest)
from jaxserve.request import FinishReason, Request

log = logging.getLogger("jaxserve")

PARAMS = "kv_transfer_params"
MAX_REASONS = 16                # recent failure reasons kept (stats, tests)


@dataclass(slots=True)
class Load:
    req_id: str
    block_ids: list[int]            # the blocks the pulled data goes into
    num_tokens: int                 # tokens computed once written (P - 1)
    data: np.ndarray | None = None
    error: str | None = None


@dataclass(slots=True)
class TransferStats:
    saved: int = 0
    save_refused: int = 0           # buffer full
    loads: int = 0
    load_failures: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0       # summed wall time of pulls (thread side)
    failures: list[str] = field(default_factory=list)


def transfer_params(request: Request) -> dict[str, Any] | None:
    extra = request.sampling_params.extra_args or {}
    p = extra.get(PARAMS)
    return p if isinstance(p, dict) else None


def read_secret(cfg: KVTransferConfig, api_key: str | None) -> bytes:
    if cfg.secret_file:
        try:
            secret = Path(cfg.secret_file).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"--kv-transfer-config secret_file {cfg.secret_file}: "
                             f"{e.strerror}") from None
        if not secret:
            raise ValueError(f"--kv-transfer-config secret_file {cfg.secret_file} is empty")
        return secret
    return (api_key or "").encode()


class KVConnector:
    def __init__(self, cfg: KVTransferConfig, kv: Any, *, block_size: int, secret: bytes,
                 host: str, engine_id: str | None = None) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.mover = BlockMover(kv, cfg.chunk_blocks)
        self.secret = secret
        self.engine_id = engine_id or uuid.uuid4().hex
        self.stats = TransferStats()
        m = self.mover
        self.geometry = [m.num_layers, m.num_kv_heads, block_size, m.head_dim, m.dtype.str]
        self.host = cfg.kv_ip or host
        if cfg.is_producer and self.host in ("0.0.0.0", "::", ""):
            raise ValueError("--kv-transfer-config: a kv_producer serving on --host "
                             f"{host!r} needs kv_ip, the address decode servers reach it at")
        self.store: SavedStore | None = None
        self.server: TransferServer | None = None
        if cfg.is_producer:
            self.store = SavedStore(cfg.buffer_bytes, cfg.ttl)
            self.server = TransferServer(
                self.store, lambda s: m.to_host(s.chunks, s.num_blocks), self.geometry,
                host=self.host, port=cfg.kv_port,
                secret=secret, timeout=cfg.timeout)
            log.info("kv transfer: %s serving prefills on %s:%d", cfg.kv_role, self.host,
                     self.server.port)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-pull") \
            if cfg.is_consumer else None
        self._saves: list[tuple[str, list[int], bytes]] = []
        self._done: queue.SimpleQueue[Load] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self._tried: set[str] = set()   # requests that had their one chance to load
        self._stats_lock = threading.Lock()

    # ---- scheduler side -----------------------------------------------------------------
    def _remote(self, request: Request) -> dict[str, Any] | None:
        p = transfer_params(request)
        if (not self.cfg.is_consumer or p is None or not p.get("do_remote_prefill")
                or request.request_id in self._tried or request.output_token_ids):
            return None
        return p

    def num_external_tokens(self, request: Request, num_local: int) -> int:
        """Prompt tokens beyond the local hits that the remote prefill holds (its KV for
        all but the last prompt token, which this engine computes to sample)."""
        if self._remote(request) is None:
            return 0
        return max(0, request.num_prompt_tokens - 1 - num_local)

    def start_load(self, request: Request, block_ids: list[int], num_local: int) -> None:
        """Pull the blocks after the local hits into block_ids (fresh blocks)."""
        p = self._remote(request)
        assert p is not None
        rid = request.request_id
        self._tried.add(rid)
        n_tokens = request.num_prompt_tokens - 1
        first = num_local // self.block_size
        digest = token_digest(request.prompt_token_ids[:n_tokens])
        load = Load(rid, list(block_ids), n_tokens)
        assert self._pool is not None
        self._pool.submit(self._pull, load, p, first, digest)

    def release_remote(self, request: Request) -> None:
        """Nothing to pull (all local hits): tell the prefill server to drop its copy."""
        p = self._remote(request)
        if p is None:
            return
        self._tried.add(request.request_id)
        digest = token_digest(request.prompt_token_ids[:request.num_prompt_tokens - 1])
        assert self._pool is not None
        self._pool.submit(self._release, p, digest)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """A request finished in a step's update: a producer saves its prefill."""
        self._tried.discard(request.request_id)
        p = transfer_params(request)
        if (not self.cfg.is_producer or p is None or not p.get("do_remote_decode")
                or request.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)):
            return
        n_tokens = request.num_prompt_tokens - 1
        n_blocks = -(-n_tokens // self.block_size)
        if n_blocks == 0:
            return
        self._saves.append((str(p.get("transfer_id")), block_ids[:n_blocks],
                            token_digest(request.prompt_token_ids[:n_tokens])))

    def forget(self, req_id: str) -> None:
        self._tried.discard(req_id)

    # ---- worker side (engine thread) ----------------------------------------------------
    def save_pending(self, kv: Any) -> None:
        """Dispatch the gathers of prefills finished this step (before any later step can
        reuse their blocks; the device runs them in order)."""
        saves, self._saves = self._saves, []
        for tid, block_ids, digest in saves:
            assert self.store is not None
            nbytes = len(block_ids) * self.mover.bytes_per_block
            if self.store.nbytes + nbytes > self.store.max_bytes:
                self.stats.save_refused += 1
                continue
            chunks = self.mover.gather(kv, block_ids)
            if self.store.put(tid, chunks, len(block_ids), digest, nbytes):
                self.stats.saved += 1
            else:
                self.stats.save_refused += 1

    def finished_loads(self) -> list[Load]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                self._arrived.clear()
                return out

    def write(self, kv: Any, load: Load) -> Any:
        assert load.data is not None
        self.stats.blocks_loaded += len(load.block_ids)
        return self.mover.scatter(kv, load.block_ids, load.data)

    def wait(self, timeout: float) -> None:
        """Idle engine with loads in flight: sleep until one arrives (or timeout)."""
        self._arrived.wait(timeout)

    def warmup(self, kv: Any) -> Any:
        return self.mover.warmup(kv)

    def advertise(self, transfer_id: str) -> dict[str, Any] | None:
        """kv_transfer_params for a prefill response (None: nothing saved)."""
        if self.store is None or self.server is None or not self.store.has(transfer_id):
            return None
        return {"do_remote_prefill": True, "remote_host": self.host,
                "remote_port": self.server.port, "remote_engine_id": self.engine_id,
                "transfer_id": transfer_id}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- pull threads -------------------------------------------------------------------
    def _pull(self, load: Load, p: dict[str, Any], first: int, digest: bytes) -> None:
        t0 = time.perf_counter()
        n = len(load.block_ids)
        try:
            load.data = fetch(
                str(p.get("remote_host")), int(p.get("remote_port", 0)),
                transfer_id=str(p.get("transfer_id")), first_block=first, num_blocks=n,
                digest=digest, geometry=self.geometry, shape=self.mover.host_shape(n),
                dtype=self.mover.dtype, secret=self.secret, timeout=self.cfg.timeout,
                wire=self.cfg.wire_dtype)
        except (TransferError, TypeError, ValueError) as e:
            load.error = str(e)
            log.warning("kv transfer: pull for %s failed (recomputing it): %s",
                        load.req_id, e)
        with self._stats_lock:          # several pull threads
            st = self.stats
            st.load_seconds += time.perf_counter() - t0
            if load.error is None and load.data is not None:
                st.loads += 1
                st.bytes_loaded += load.data.nbytes
            else:
                st.load_failures += 1
                st.failures = [*st.failures[-(MAX_REASONS - 1):], str(load.error)]
        self._done.put(load)
        self._arrived.set()

    def _release(self, p: dict[str, Any], digest: bytes) -> None:
        try:
            fetch(str(p.get("remote_host")), int(p.get("remote_port", 0)),
                  transfer_id=str(p.get("transfer_id")), first_block=0, num_blocks=0,
                  digest=digest, geometry=self.geometry, shape=(0,), dtype=self.mover.dtype,
                  secret=self.secret, timeout=self.cfg.timeout)
        except (TransferError, TypeError, ValueError) as e:
            log.info("kv transfer: release failed (the prefill server's ttl frees it): %s", e)
