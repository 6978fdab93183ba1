"""Data parallelism: DP engine replicas, each on its own slice of the mesh, behind one front.

    mesh (DP=2 x TP=4)          DataParallelEngine
      data 0: [d0 d1 d2 d3]  <-  replica 0: EngineCore (scheduler, KV cache, runner)
      data 1: [d4 d5 d6 d7]  <-  replica 1: EngineCore (scheduler, KV cache, runner)

A new request goes to the replica with the least load, waiting * 4 + running (vLLM's
score: a queued request costs more than one already running); a request stays on its
replica for life. `step()` steps every replica at once, one thread each, and returns
their outputs together, so the front implements EngineClient (core/client.py) like
EngineCore and LLM / AsyncEngine / the server use it unchanged.

Why threads in one process and not processes: each replica's step spends almost all of
its time inside XLA (dispatch and device execution release the GIL), its host work is
small, and one process can drive disjoint device slices directly — TPU runtimes give
all of a host's chips to one process, so processes would need per-process chip
visibility flags. Threads also share the host copy of the weights. All replicas are
stepped together and the caller waits for all of them, so no scheduler is ever touched
by two threads at once (add/abort happen between steps) and no locks are needed.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from jaxserve.config import ConfigError, EngineArgs
from jaxserve.core.client import EngineClient, EngineSnapshot
from jaxserve.core.engine_core import EngineCore, EngineCoreOutput, EngineStats
from jaxserve.parallel.shard import ShardingPlan, mesh_and_rules_from_args
from jaxserve.request import FinishReason, Request

log = logging.getLogger("jaxserve")

WAITING_WEIGHT = 4


def replica_load(engine: EngineCore) -> int:
    s = engine.scheduler
    return s.num_waiting * WAITING_WEIGHT + s.num_running


class DataParallelEngine:
    def __init__(self, args: EngineArgs, model_cfg: Any, weights: Any, *,
                 plans: list[ShardingPlan], eos_token_ids: tuple[int, ...] = (),
                 warmup: bool = True, progress: bool = True, tokenizer: Any = None) -> None:
        self.args = args
        self.model_cfg = model_cfg
        self.plans = plans
        self.replicas: list[EngineCore] = []
        for i, plan in enumerate(plans):
            log.info("data parallel: replica %d of %d on devices %s", i, len(plans),
                     [d.id for d in plan.mesh.devices.flat])
            with jax.default_device(plan.mesh.devices.flat[0]):
                self.replicas.append(EngineCore(args, model_cfg, weights,
                                                eos_token_ids=eos_token_ids, warmup=warmup,
                                                progress=progress, plan=plan,
                                                tokenizer=tokenizer))
        first = self.replicas[0]
        self.max_model_len = first.max_model_len
        self.eos_token_ids = first.eos_token_ids
        self.warmup_seconds = sum(r.warmup_seconds for r in self.replicas)
        # request id -> replica index, unfinished requests only: every way out (finished
        # in a step, aborted, finished by the caller) forgets the id, so it cannot grow.
        self._where: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(len(plans), thread_name_prefix="dp-replica")
        self._steps = 0

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        loads = [replica_load(r) for r in self.replicas]
        i = loads.index(min(loads))
        self.replicas[i].add_request(request)      # raises ValueError: nothing recorded
        self._where[request.request_id] = i

    def _take_by_replica(self, req_ids: Iterable[str]) -> dict[int, list[str]]:
        """Group ids by replica and forget them (the caller finishes them there)."""
        groups: dict[int, list[str]] = {}
        for rid in req_ids:
            i = self._where.pop(rid, None)
            if i is not None:
                groups.setdefault(i, []).append(rid)
        return groups

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        for i, ids in self._take_by_replica(req_ids).items():
            self.replicas[i].abort_requests(ids)

    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> None:
        for i, ids in self._take_by_replica(req_ids).items():
            self.replicas[i].finish_requests(ids, reason)

    @property
    def num_tracked_requests(self) -> int:
        """Unfinished requests this front routes (tests: must not grow without bound)."""
        return len(self._where)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        futures = [self._pool.submit(self._step_replica, r, p)
                   for r, p in zip(self.replicas, self.plans)]
        outs: list[EngineCoreOutput] = []
        for f in futures:
            outs.extend(f.result())                # re-raises a replica's error here
        for o in outs:
            if o.finish_reason is not None:
                self._where.pop(o.req_id, None)
        self._steps += 1
        return outs

    @staticmethod
    def _step_replica(engine: EngineCore, plan: ShardingPlan) -> list[EngineCoreOutput]:
        # Host inputs land on the replica's first device instead of global device 0.
        with jax.default_device(plan.mesh.devices.flat[0]):
            return engine.step()

    # ---- introspection ----------------------------------------------------------------
    @property
    def num_compiles(self) -> int:
        return sum(r.num_compiles for r in self.replicas)

    @property
    def stats(self) -> EngineStats:
        total = EngineStats(steps=self._steps)
        for r in self.replicas:
            s = r.stats
            total.host_seconds += s.host_seconds
            total.device_seconds += s.device_seconds
            total.wait_seconds += s.wait_seconds
            total.overlapped_seconds += s.overlapped_seconds
            total.prompt_tokens += s.prompt_tokens
            total.generation_tokens += s.generation_tokens
            total.scheduled_tokens += s.scheduled_tokens
            for k, v in s.finished.items():
                total.finished[k] = total.finished.get(k, 0) + v
        return total

    def loads(self) -> list[int]:
        return [replica_load(r) for r in self.replicas]

    def reset_prefix_cache(self) -> bool:
        return all([r.reset_prefix_cache() for r in self.replicas])

    def kv_transfer_params(self, transfer_id: str) -> dict[str, Any] | None:
        return None         # never with KV transfer: make_engine refuses the pair

    def snapshot(self) -> EngineSnapshot:
        """Sum over replicas (kv_usage is then used / total blocks of all pools)."""
        return EngineSnapshot.total([r.snapshot() for r in self.replicas], steps=self._steps)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        for replica in self.replicas:   # each writes its offloaded KV to disk, if any
            replica.shutdown()


def make_engine(args: EngineArgs, model_cfg: Any, weights: Any, **kw: Any) -> EngineClient:
    """EngineCore for one replica (sharded or not), DataParallelEngine for several."""
    if args.kv_transfer_config and args.data_parallel_size > 1:
        # in-process replicas would share one transfer endpoint and kv_transfer_params
        # name no replica; `serve --data-parallel-backend processes` gives each its own
        raise ConfigError("kv_transfer_config with data_parallel_size > 1 runs only as "
                          "`jaxserve serve --data-parallel-backend processes` (one transfer "
                          "endpoint per replica process), not in-process replicas")
    found = mesh_and_rules_from_args(args)
    if found is None or found[0].shape["data"] == 1:
        return EngineCore(args, model_cfg, weights, **kw)
    mesh, rules = found
    if args.num_hosts > 1:
        raise ConfigError("data parallelism across hosts is not supported")
    plan = ShardingPlan.build(model_cfg, mesh, rules)
    return DataParallelEngine(args, model_cfg, weights, plans=plan.replicas(), **kw)
