"""KVOffload: the host-memory and disk tiers behind the device prefix cache.

    device pool (core/kv)        evicts a cached block  --save-->   host tier (LRU, bytes)
         ^                                                             |  written through
         |  scatter into fresh blocks  <--load--  host hit             v
         +-------------------------------------<--load--  disk hit   disk tier (files)

Out: when the KV manager hands a cached block to other content (block_pool.py records
the (block id, hash) of each such eviction), the engine calls `save` before it
dispatches the step, which gathers those blocks (one fixed-shape jitted program per
chunk) ahead of the step that overwrites them; the device runs them in order. The
rows reach the host tier at the next step (`flush`), by when the gather has long run.
Blocks already in the host tier are only refreshed in its LRU, not copied again. With a
disk tier each new host row is also queued for a background writer (write-through), so
the directory holds every block that ever left the device, up to its bound, and a
restarted server finds them.

In: for a request with no blocks, the scheduler asks `lookup` how many blocks past its
device prefix hits the tiers hold (consecutive hashes: the same tokens, cache salt and
model, since those are in the hash). It allocates fresh blocks for them through the KV
manager (the only writer of block tables) and calls `start_load`. All of them in host
memory: the rows are scattered into the blocks before the step is dispatched
(`write_ready`: every load of the step in one pass), and the request runs in the same
step with them computed. Some on
disk: the files are read on a thread while the request waits off the queue (as a KV
transfer load does); the next step scatters what was read, up to the first block that
failed (a damaged file is a miss), and the request computes the rest.

Nothing here runs per token; per step the work is bounded by the blocks the scheduler
allocated or evicted in it.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxserve.kv_transfer.offload_copy import BlockCopier
from jaxserve.kv_transfer.offload_tiers import DiskTier, HostTier

log = logging.getLogger("jaxserve")

CHUNK_BLOCKS = 16               # blocks per gather / scatter call
MAX_WRITE_BYTES = 256 << 20     # rows waiting for the disk writer (more are dropped)


@dataclass(slots=True)
class OffloadStats:
    """Counters for /metrics: tokens looked up / found per tier, bytes moved."""
    host_queries: int = 0
    host_hits: int = 0
    disk_queries: int = 0
    disk_hits: int = 0
    bytes_to_host: int = 0          # device -> host (saves)
    bytes_to_device: int = 0        # host -> device (loads)
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    disk_write_dropped: int = 0     # the writer's queue was full


@dataclass(slots=True)
class OffloadLoad:
    req_id: str
    block_ids: list[int]
    num_base: int                   # tokens computed before these blocks
    hashes: list[bytes]
    rows: list[np.ndarray] = field(default_factory=list)   # the blocks read, in order
    disk_rows: int = 0              # of those, read from files


def model_fingerprint(model: str | None, model_cfg: Any, weights: Any, *, dtype: Any,
                      kv_cache_dtype: str, block_size: int) -> bytes:
    """32 bytes that differ between models (config, weights' shapes and a sample of their
    values), compute and cache dtypes and block sizes: a disk block written by any other
    engine than one of these is foreign."""
    h = hashlib.blake2b(digest_size=32)
    h.update(repr((model, model_cfg, str(dtype), kv_cache_dtype, block_size)).encode())
    leaves = jax.tree.leaves(weights)
    for i, x in enumerate(leaves):
        h.update(repr((tuple(x.shape), str(x.dtype))).encode())
        if i < 4 and x.ndim > 0:
            sample = x[(0,) * (x.ndim - 1)][:64]
            h.update(np.asarray(jax.device_get(sample)).tobytes())
    return h.digest()


class KVOffload:
    def __init__(self, kv: Any, *, block_size: int, host_bytes: int,
                 disk_dir: str | None, disk_bytes: int, fingerprint: bytes,
                 chunk_blocks: int = CHUNK_BLOCKS) -> None:
        self.block_size = block_size
        self.copier = BlockCopier(kv, chunk_blocks)
        self.row_bytes = self.copier.bytes_per_block
        self.host = HostTier(host_bytes)
        layout = hashlib.blake2b(self.copier.describe().encode(), digest_size=32).digest()
        self.disk = (DiskTier(disk_dir, disk_bytes, fingerprint, layout, self.row_bytes)
                     if disk_dir else None)
        self.stats = OffloadStats()
        self._saving: list[tuple[list[bytes], list[jax.Array]]] = []   # gathers in flight
        self._ready: list[OffloadLoad] = []         # host loads to scatter this step
        self._done: queue.SimpleQueue[OffloadLoad] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self.num_reading = 0
        self._tally = (0, 0, 0, 0)          # the last lookup's counts, until acted on
        self._readers: ThreadPoolExecutor | None = None
        self._writes: queue.Queue[tuple[bytes, np.ndarray] | None] | None = None
        self._writer: threading.Thread | None = None
        # rows queued for the disk writer, not yet in a file: still hits (in memory)
        self._unwritten: dict[bytes, np.ndarray] = {}
        if self.disk is not None and self.disk.enabled:
            self._readers = ThreadPoolExecutor(2, thread_name_prefix="kv-disk-read")
            self._writes = queue.Queue(max(16, min(MAX_WRITE_BYTES, host_bytes)
                                           // self.row_bytes))
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk-write",
                                            daemon=True)
            self._writer.start()
        log.info("kv offload: host tier %.1f MiB (%d blocks of %d bytes)%s",
                 host_bytes / 2**20, host_bytes // self.row_bytes, self.row_bytes,
                 "" if self.disk is None else
                 f", disk tier {disk_bytes / 2**20:.1f} MiB at {self.disk.dir} "
                 f"({len(self.disk)} blocks there"
                 f"{'' if self.disk.enabled else ', turned off'})")

    @property
    def hash_key(self) -> bytes | None:
        """The prefix-hash key the KV manager must use (None: its own random one)."""
        return self.disk.key if self.disk is not None and self.disk.enabled else None

    # ---- scheduler side ------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> int:
        """How many of these consecutive blocks (those past the device hits) the host or
        disk tier holds, from the first. Counted in the stats once the scheduler acts on
        it (a miss here, or start_load), not on a retry."""
        disk = self.disk if self.disk is not None and self.disk.enabled else None
        n = in_host = 0
        first_miss = len(hashes)            # first block not in memory
        for i, h in enumerate(hashes):
            if h in self.host or h in self._unwritten:
                in_host += 1
            elif disk is not None and h in disk:
                first_miss = min(first_miss, i)
            else:
                first_miss = min(first_miss, i)
                break
            n = i + 1
        bs = self.block_size
        self._tally = (len(hashes) * bs, in_host * bs,
                       (len(hashes) - first_miss) * bs if disk is not None else 0,
                       (n - in_host) * bs)
        if n == 0:
            self._count()
        return n

    def _count(self) -> None:
        st = self.stats
        q, h, dq, dh = self._tally
        st.host_queries += q
        st.host_hits += h
        st.disk_queries += dq
        st.disk_hits += dh
        self._tally = (0, 0, 0, 0)

    def start_load(self, req_id: str, hashes: list[bytes], block_ids: list[int],
                   num_base: int) -> bool:
        """Fill block_ids with the blocks of these hashes. True: all in host memory,
        written before this step runs; False: some are read from disk (finished_loads
        reports the load)."""
        self._count()
        load = OffloadLoad(req_id, list(block_ids), num_base, list(hashes))
        rows = [self._in_memory(h) for h in hashes]
        if all(r is not None for r in rows):
            load.rows = rows        # type: ignore[assignment]
            self._ready.append(load)
            return True
        assert self._readers is not None
        self.num_reading += 1
        self._readers.submit(self._read, load, hashes, rows)
        return False

    def _in_memory(self, h: bytes) -> np.ndarray | None:
        row = self.host.get(h)
        return row if row is not None else self._unwritten.get(h)

    # ---- worker side (engine thread) -----------------------------------------------
    def save(self, kv: Any, evicted: Sequence[tuple[int, bytes]]) -> None:
        """Dispatch the gathers of blocks evicted while scheduling this step (before the
        step that reuses them is dispatched)."""
        new = []
        disk = self.disk if self.disk is not None and self.disk.enabled else None
        for block_id, h in evicted:
            if h in self.host:
                self.host.touch(h)
            elif h in self._unwritten or (disk is not None and h in disk):
                continue                    # already held: a copy would add nothing
            elif self.host.max_bytes or disk is not None:
                new.append((block_id, h))
        if new:
            self._saving.append(([h for _, h in new],
                                 self.copier.gather(kv, [b for b, _ in new])))

    def flush(self) -> None:
        """Saved blocks reach the host tier (and the disk writer's queue)."""
        saving, self._saving = self._saving, []
        for hashes, chunks in saving:
            for h, row in zip(hashes, self.copier.rows(chunks, len(hashes))):
                self.stats.bytes_to_host += row.nbytes
                if self.host.max_bytes:
                    self.host.put(h, row)
                self._queue_write(h, row)

    def write_ready(self, kv: Any) -> Any:
        """Scatter the host loads started this step; returns the new cache."""
        ready, self._ready = self._ready, []
        return self.write(kv, ready)

    def write(self, kv: Any, loads: list[OffloadLoad]) -> Any:
        """Scatter the rows of these loads, all in one pass of fixed-size chunks."""
        ids: list[int] = []
        rows: list[np.ndarray] = []
        for load in loads:
            ids += load.block_ids[:len(load.rows)]
            rows += load.rows
        if ids:
            kv = self.copier.scatter(kv, ids, rows)
            self.stats.bytes_to_device += len(ids) * self.row_bytes
        return kv

    def finished_loads(self) -> list[OffloadLoad]:
        """Disk loads whose reads ended (rows: the blocks read before the first miss)."""
        out = []
        while True:
            try:
                load = self._done.get_nowait()
            except queue.Empty:
                self._arrived.clear()
                return out
            self.num_reading -= 1
            self.stats.bytes_from_disk += load.disk_rows * self.row_bytes
            if self.host.max_bytes:         # what came from disk is hot again
                for h, row in zip(load.hashes, load.rows):
                    if h not in self.host:
                        self.host.put(h, row)
            out.append(load)

    def wait(self, timeout: float) -> None:
        """Idle but for disk reads: sleep until one ends (or timeout)."""
        self._arrived.wait(timeout)

    def warmup(self, kv: Any) -> Any:
        return self.copier.warmup(kv)

    def reset(self) -> None:
        """Forget the host tier (the disk tier is kept: it outlives the process)."""
        self.host.clear()

    def persist(self, kv: Any, cached: Sequence[tuple[int, bytes]]) -> None:
        """At shutdown, with a disk tier: the blocks still cached on the device go to disk
        too (as many as the writer's queue takes), so a restart finds every prefix."""
        if self.disk is None or not self.disk.enabled:
            return
        self.flush()
        self.save(kv, [(b, h) for b, h in cached if h not in self.disk])
        self.flush()

    def close(self) -> None:
        """Finish the queued disk writes (bounded wait: they make a restart fast), stop
        the threads."""
        self.drain_writes(10.0)
        if self._writes is not None:
            try:
                self._writes.put_nowait(None)
            except queue.Full:
                pass
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)

    # ---- threads -------------------------------------------------------------------
    def _queue_write(self, h: bytes, row: np.ndarray) -> None:
        if self._writes is None or self.disk is None or not self.disk.enabled:
            return
        self._unwritten[h] = row        # before the writer can see (and drop) it
        try:
            self._writes.put_nowait((h, row))
        except queue.Full:
            self._unwritten.pop(h, None)
            self.stats.disk_write_dropped += 1

    def _write_loop(self) -> None:
        assert self._writes is not None and self.disk is not None
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                if self.disk.write(*item):
                    self.stats.bytes_to_disk += item[1].nbytes     # this thread only
                self._unwritten.pop(item[0], None)
            finally:
                self._writes.task_done()

    def drain_writes(self, timeout: float = 30.0) -> bool:
        """Wait (at most timeout s) until the writer has written everything queued
        (tests, shutdown); False if it has not."""
        w = self._writes
        if w is None or self._writer is None or not self._writer.is_alive():
            return True
        deadline = time.monotonic() + timeout
        while w.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not w.unfinished_tasks

    def _read(self, load: OffloadLoad, hashes: list[bytes],
              rows: list[np.ndarray | None]) -> None:
        assert self.disk is not None
        try:
            for h, row in zip(hashes, rows):
                if row is None:
                    row = self.disk.read(h)
                    if row is None:
                        break
                    load.disk_rows += 1
                load.rows.append(row)
        finally:
            self._done.put(load)
            self._arrived.set()
