"""The engine's KV traffic beyond its device pool: the KV transfer connector (prefill on
one engine, decode on another: kv_transfer/connector.py) and the offload tiers behind
the prefix cache (host memory and disk: kv_transfer/offload.py).

EngineCore builds one ExternalKV when either is configured and calls it at three points
of every step: before scheduling (`take_in`: finished pulls and disk reads are written
into the cache and their requests requeued), after scheduling and before dispatch
(`before_dispatch`: the blocks the schedule evicted are read out, host hits written in),
and after the step's update (`after_update`: finished prefills are read out for their
decode engines before their blocks are reused). The scheduler decides which requests
load (core/sched/loading.py); this object moves the bytes, always through the runner's
cache arrays, which it replaces with the updated ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxserve.config import EngineArgs
from jaxserve.core.kv.manager import KVCacheManager

if TYPE_CHECKING:     # imported only when a server transfers or offloads KV
    from jaxserve.core.sched.scheduler import Scheduler
    from jaxserve.kv_transfer.connector import KVConnector
    from jaxserve.kv_transfer.offload import KVOffload


def make_offload(args: EngineArgs, model_cfg: Any, weights: Any, runner: Any, *, dtype: Any,
                 kv_cache_dtype: str, warmup: bool) -> KVOffload | None:
    """The offload tiers, or None: no --kv-offload-bytes / --kv-offload-dir, or no
    prefix caching (nothing is cached to offload)."""
    if not (args.kv_offload_bytes or args.kv_offload_dir) or not args.enable_prefix_caching:
        return None
    from jaxserve.kv_transfer.offload import KVOffload, model_fingerprint
    fp = model_fingerprint(args.model, model_cfg, weights, dtype=dtype,
                           kv_cache_dtype=kv_cache_dtype, block_size=args.block_size)
    off = KVOffload(runner.kv, block_size=args.block_size,
                    host_bytes=args.kv_offload_bytes, disk_dir=args.kv_offload_dir,
                    disk_bytes=args.kv_offload_dir_bytes, fingerprint=fp)
    if warmup:      # compile the block gather/scatter now, not on the first eviction
        runner.kv = off.warmup(runner.kv)
    return off


def make_connector(args: EngineArgs, runner: Any, *, warmup: bool) -> KVConnector | None:
    """The KV transfer connector, or None without --kv-transfer-config."""
    if not args.kv_transfer_config:
        return None
    from jaxserve.kv_transfer.config import parse_kv_transfer_config
    from jaxserve.kv_transfer.connector import KVConnector, read_secret
    cfg = parse_kv_transfer_config(args.kv_transfer_config)
    conn = KVConnector(cfg, runner.kv, block_size=args.block_size,
                       secret=read_secret(cfg, args.api_key), host=args.host)
    if warmup:      # compile the block gather/scatter now, not on the first transfer
        runner.kv = conn.warmup(runner.kv)
    return conn


class ExternalKV:
    def __init__(self, runner: Any, kv_manager: KVCacheManager, *,
                 offload: KVOffload | None, connector: KVConnector | None) -> None:
        self.runner = runner
        self.kv_manager = kv_manager
        self.offload = offload
        self.connector = connector

    def max_loading_blocks(self) -> int | None:
        """Fresh blocks the KV pulls and disk reads may hold at once (None: no cap)."""
        if self.connector is not None:
            return int(self.connector.cfg.max_loading_fraction * self.kv_manager.num_blocks)
        if self.offload is not None:
            return self.kv_manager.num_blocks // 2
        return None

    def take_in(self, s: Scheduler, idle: bool) -> None:
        """Before scheduling. idle: no step is in flight, so waiting a little for a
        load instead of spinning costs no overlap."""
        if self.connector is not None:
            self._transfer_in(s, idle)
        if self.offload is not None:
            self._offload_in(s, idle)

    def _transfer_in(self, s: Scheduler, idle: bool) -> None:
        """Write the blocks of finished pulls into the cache and requeue their requests
        (failed pulls requeue to recompute)."""
        conn = self.connector
        assert conn is not None
        if idle and s.loading and not s.running and not s.waiting:
            conn.wait(0.05)
        for load in conn.finished_loads():
            if load.req_id not in s.loading:
                continue                    # finished (aborted) meanwhile: drop the data
            if load.error is None:
                self.runner.kv = conn.write(self.runner.kv, load)
            s.finish_loading(load.req_id, None if load.error else load.num_tokens)

    def _offload_in(self, s: Scheduler, idle: bool) -> None:
        """Saved blocks reach the host tier; the blocks of finished disk reads are
        written in and their requests requeued (with what was read; the rest, or all of
        it if nothing was, computed)."""
        off = self.offload
        assert off is not None
        off.flush()
        if idle and off.num_reading and not s.running and not s.waiting:
            off.wait(0.05)
        # loads of requests finished (aborted) meanwhile are dropped
        loads = [ld for ld in off.finished_loads() if ld.req_id in s.loading]
        self.runner.kv = off.write(self.runner.kv, loads)
        for load in loads:
            done = load.num_base + len(load.rows) * self.kv_manager.block_size
            s.finish_loading(load.req_id, done or None)

    def before_dispatch(self) -> None:
        """Read out the cached blocks this schedule evicted, then write in the host
        hits it scheduled (possibly into those blocks)."""
        off = self.offload
        if off is not None:
            off.save(self.runner.kv, self.kv_manager.take_evicted())
            self.runner.kv = off.write_ready(self.runner.kv)

    def after_update(self) -> None:
        """Read finished prefills out before their blocks are reused."""
        if self.connector is not None:
            self.connector.save_pending(self.runner.kv)

    def reset(self) -> None:
        """The prefix cache was reset: so is the host tier (the disk tier stays)."""
        if self.offload is not None:
            self.offload.reset()

    def counters(self) -> dict[str, int]:
        """The offload tiers' counters, as EngineSnapshot fields."""
        off = self.offload
        if off is None:
            return {}
        st = off.stats
        return dict(
            offload_host_queries=st.host_queries, offload_host_hits=st.host_hits,
            offload_disk_queries=st.disk_queries, offload_disk_hits=st.disk_hits,
            offload_bytes_to_host=st.bytes_to_host, offload_bytes_to_device=st.bytes_to_device,
            offload_bytes_to_disk=st.bytes_to_disk, offload_bytes_from_disk=st.bytes_from_disk,
            offload_host_bytes=off.host.nbytes,
            offload_disk_bytes=off.disk.nbytes if off.disk is not None else 0)

    def close(self) -> None:
        """The transfer endpoint closes; the device's cached blocks go to the disk tier
        (if any), then its writes finish."""
        if self.connector is not None:
            self.connector.close()
        off = self.offload
        if off is not None:
            off.persist(self.runner.kv, self.kv_manager.cached_blocks())
            off.close()
