"""KVConnector: disaggregated prefill/decode with vLLM's split of duties.

Scheduler side (host decisions, called by core/sched/scheduler.py on the engine thread):
  * num_external_tokens(request, num_local)   how many of a request's prompt tokens a
                                              remote prefill holds beyond the local
                                              prefix hits (0: none, compute as usual)
  * start_load(request, block_ids, first)     pull them into these (fresh) blocks; the
                                              request waits off the queue meanwhile
  * request_finished(request, block_ids)      a producer's prefill finished: save it
Worker side (device arrays, called by core/engine_core.py on the engine thread):
  * save_pending(kv)                          read the saved prefills' blocks out
                                              (jitted gather) before their blocks can
                                              be reused by the next step
  * finished_loads() / write(kv, load)        loads whose bytes arrived (or failed);
                                              write them in (jitted scatter)

A request's life on the two servers (the router drives it; docs/serving.md):

  prefill server  prompt, max_tokens=1, kv_transfer_params {do_remote_decode}
                  -> finished: blocks read out into the SavedStore (bounded, ttl), its
                     blocks freed at once; the response advertises {do_remote_prefill,
                     remote_host, remote_port, remote_engine_id, transfer_id,
                     prompt_digest, expires, signature}, signed with the transfer secret
  decode server   the original request + those kv_transfer_params
                  -> only params whose signature, expiry and prompt digest check out
                     (and whose endpoint is in prefill_endpoints, when that is set) are
                     acted on; any others are ignored and the prompt computed here, so
                     a client can never name an endpoint this server connects to
                  -> local prefix hits h; blocks for tokens [h, P-1) allocated (not yet
                     hashed), pulled on a thread, scattered in; then the request joins
                     the queue with P-1 tokens computed and computes the last prompt
                     token itself (so it samples every output token, seeded or not)
                  -> a failed pull, or one still running `timeout` seconds after it
                     started, frees those blocks and recomputes; pending pulls hold at
                     most max_loading_fraction of the pool (the scheduler's cap)

Blocks are the KV manager's to give and free; nothing here writes a block table.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.kv_transfer.blocks import BlockMover
from jaxserve.kv_transfer.config import SECRET_ENV, KVTransferConfig, endpoint, read_secret
from jaxserve.kv_transfer.transport import (SavedStore, TransferError, TransferServer,
                                            fetch, token_digest)
from jaxserve.request import FinishReason, Request

log = logging.getLogger("jaxserve")

PARAMS = "kv_transfer_params"
MAX_REASONS = 16                # recent failure reasons kept (stats, tests)
SIGNED = ("remote_host", "remote_port", "remote_engine_id", "transfer_id", "prompt_digest",
          "expires")


@dataclass(slots=True)
class Load:
    req_id: str
    block_ids: list[int]            # the blocks the pulled data goes into
    num_tokens: int                 # tokens computed once written (P - 1)
    data: np.ndarray | None = None
    error: str | None = None
    seconds: float = 0.0            # the pull's wall time (thread side)


@dataclass(slots=True)
class TransferStats:
    saved: int = 0
    save_refused: int = 0           # buffer full
    loads: int = 0
    load_failures: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0       # summed wall time of pulls (thread side)
    load_timeouts: int = 0          # pulls given up at their deadline (counted in failures)
    params_ignored: int = 0         # kv_transfer_params not signed by a prefill server
    failures: list[str] = field(default_factory=list)


def transfer_params(request: Request) -> dict[str, Any] | None:
    extra = request.sampling_params.extra_args or {}
    p = extra.get(PARAMS)
    return p if isinstance(p, dict) else None


def sign_params(secret: bytes, p: dict[str, Any]) -> str:
    msg = json.dumps([p.get(k) for k in SIGNED], separators=(",", ":"), default=str).encode()
    return hmac.new(secret, b"jaxserve-kv-params-v1|" + msg, hashlib.sha256).hexdigest()


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
                host=self.host, port=cfg.kv_port, secret=secret, timeout=cfg.timeout,
                handshake_timeout=cfg.handshake_timeout,
                max_peer_connections=cfg.max_peer_connections)
            log.info("kv transfer: %s serving prefills on %s:%d", cfg.kv_role, self.host,
                     self.server.port)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-pull") \
            if cfg.is_consumer else None
        self._saves: list[tuple[str, list[int], bytes]] = []
        self._done: queue.SimpleQueue[Load] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self._tried: set[str] = set()   # requests that had their one chance to load
        self._verified: set[str] = set()    # requests whose params checked out
        self._deadlines: dict[str, float] = {}  # pulls in flight -> monotonic deadline

    # ---- scheduler side -----------------------------------------------------------------
    def _remote(self, request: Request) -> dict[str, Any] | None:
        p = transfer_params(request)
        rid = request.request_id
        if (not self.cfg.is_consumer or p is None or not p.get("do_remote_prefill")
                or rid in self._tried or request.output_token_ids):
            return None
        if rid not in self._verified:
            why = self._refuse_params(p, request)
            if why:
                self._tried.add(rid)
                self.stats.params_ignored += 1
                self._note_failure(f"params ignored: {why}")
                log.info("kv transfer: kv_transfer_params of %s ignored (computing the "
                         "prompt here): %s", rid, why)
                return None
            self._verified.add(rid)
        return p

    def _refuse_params(self, p: dict[str, Any], request: Request) -> str:
        """Why a request's params must not make this server connect anywhere ("" when
        a prefill server holding the secret issued them for exactly this prompt)."""
        sig = p.get("signature")
        if not (isinstance(sig, str) and hmac.compare_digest(
                sig, sign_params(self.secret, p))):
            return "not signed by a prefill server with this server's transfer secret"
        expires = p.get("expires")
        if not isinstance(expires, (int, float)) or expires < time.time():
            return "expired"
        want = token_digest(request.prompt_token_ids[:request.num_prompt_tokens - 1])
        if p.get("prompt_digest") != want.hex():
            return "prefilled for another prompt"
        allowed = self.cfg.prefill_endpoints
        if allowed and endpoint(str(p.get("remote_host")),
                                int(p.get("remote_port") or 0)) not in allowed:
            return "its endpoint is not in prefill_endpoints"
        return ""

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
        deadline = time.monotonic() + self.cfg.timeout
        self._deadlines[rid] = deadline
        assert self._pool is not None
        self._pool.submit(self._pull, load, p, first, digest, deadline)

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
        self._verified.discard(request.request_id)
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
        self._verified.discard(req_id)
        self._deadlines.pop(req_id, None)

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
        """Pulls that ended, and pulls past their deadline as failures (their late data,
        should it come, is dropped: their blocks may already hold another request's KV)."""
        out = []
        while True:
            try:
                load = self._done.get_nowait()
            except queue.Empty:
                self._arrived.clear()
                break
            if self._deadlines.pop(load.req_id, None) is not None:
                self._count(load)
                out.append(load)
        now = time.monotonic()
        for rid in [r for r, d in self._deadlines.items() if d <= now]:
            del self._deadlines[rid]
            load = Load(rid, [], 0, error=f"no data within {self.cfg.timeout:g} s",
                        seconds=self.cfg.timeout)
            self.stats.load_timeouts += 1
            log.warning("kv transfer: pull for %s timed out (recomputing it)", rid)
            self._count(load)
            out.append(load)
        return out

    def _count(self, load: Load) -> None:
        st = self.stats
        st.load_seconds += load.seconds
        if load.error is None and load.data is not None:
            st.loads += 1
            st.bytes_loaded += load.data.nbytes
        else:
            st.load_failures += 1
            self._note_failure(str(load.error))

    def _note_failure(self, why: str) -> None:
        self.stats.failures = [*self.stats.failures[-(MAX_REASONS - 1):], why]

    def write(self, kv: Any, load: Load) -> Any:
        assert load.data is not None
        self.stats.blocks_loaded += len(load.block_ids)
        return self.mover.scatter(kv, load.block_ids, load.data)

    def wait(self, timeout: float) -> None:
        """Idle engine with loads in flight: sleep until one arrives (or timeout)."""
        self._arrived.wait(timeout)

    @property
    def num_loading(self) -> int:
        return len(self._deadlines)

    def warmup(self, kv: Any) -> Any:
        return self.mover.warmup(kv)

    def advertise(self, transfer_id: str) -> dict[str, Any] | None:
        """kv_transfer_params for a prefill response (None: nothing saved)."""
        digest = None if self.store is None else self.store.digest(transfer_id)
        if digest is None or self.server is None:
            return None
        p: dict[str, Any] = {
            "do_remote_prefill": True, "remote_host": self.host,
            "remote_port": self.server.port, "remote_engine_id": self.engine_id,
            "transfer_id": transfer_id, "prompt_digest": digest.hex(),
            "expires": int(time.time() + self.cfg.ttl) + 1}
        p["signature"] = sign_params(self.secret, p)
        return p

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- pull threads -------------------------------------------------------------------
    def _pull(self, load: Load, p: dict[str, Any], first: int, digest: bytes,
              deadline: float) -> None:
        t0 = time.perf_counter()
        n = len(load.block_ids)
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError("its deadline passed before a pull thread was free")
            load.data = fetch(
                str(p.get("remote_host")), int(p.get("remote_port", 0)),
                transfer_id=str(p.get("transfer_id")), first_block=first, num_blocks=n,
                digest=digest, geometry=self.geometry, shape=self.mover.host_shape(n),
                dtype=self.mover.dtype, secret=self.secret, timeout=left,
                wire=self.cfg.wire_dtype)
        except (TransferError, TypeError, ValueError) as e:
            load.error = str(e)
            log.warning("kv transfer: pull for %s failed (recomputing it): %s",
                        load.req_id, e)
        load.seconds = time.perf_counter() - t0
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
