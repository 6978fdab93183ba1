"""One model over several hosts: rank 0 schedules, every rank runs the same step in lockstep.

    rank 0: HTTP / LLM -> EngineCore.step: schedule -> [broadcast SchedulerOutput] -> execute
    rank i:              Follower loop:            [receive SchedulerOutput] -> execute

JAX's multi-controller runtime needs every process to launch the same jitted step with
the same inputs; the step's collectives then run across hosts. Everything that shapes
a step is a deterministic function of the SchedulerOutput sequence (the runner's
request states, block table, padded batch, sampler state, the step's RNG key from the
step count), so rank 0 sends only that, encoded with parallel/wire.py (typed msgpack)
over parallel/control.py's channel, which also turns a dead or hung rank into a clear
error on every other rank (no hang).

Start-up on every host (before anything touches a device):

    initialize(args)                      # jax.distributed.initialize (+ gloo on CPU)
    engine = EngineCore(args, cfg, weights)   # same args everywhere: same mesh, warm-up
    rank 0:  leader = attach_leader(engine, args); ...serve...; leader.stop(); shutdown()
    rank i:  run_follower(engine, args); shutdown()      (follower_main does all of it)

The CLI needs three lines: `code = maybe_follow(args)` first (returns at once on rank 0),
then on rank 0 `leader = attach_leader(llm.engine, args)` and at exit `leader.stop()`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import jax

from jaxserve.config import ConfigError, EngineArgs
from jaxserve.parallel import wire
from jaxserve.parallel.control import Follower, Leader, die
from jaxserve.parallel.mesh import init_distributed
from jaxserve.scheduler.output import SchedulerOutput

log = logging.getLogger("jaxserve")


def control_address(args: EngineArgs) -> tuple[str, int]:
    """Rank 0's control channel: the coordinator's host, the coordinator's port + 1."""
    if not args.coordinator or ":" not in args.coordinator:
        raise ConfigError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    host, port = args.coordinator.rsplit(":", 1)
    return host, int(port) + 1


def initialize(args: EngineArgs) -> None:
    """Join the multi-host run described by args (no-op for one host)."""
    init_distributed(args.num_hosts, args.host_rank, args.coordinator,
                     timeout_s=int(max(60, args.multihost_timeout)))


class BroadcastingRunner:
    """Rank 0's runner: sends each SchedulerOutput to the other ranks, then runs it."""

    def __init__(self, inner: Any, leader: Leader) -> None:
        self._inner = inner
        self._leader = leader

    def execute(self, so: SchedulerOutput) -> Any:
        return self._inner.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput) -> Any:
        self._leader.broadcast("step", wire.encode(so))
        return self._inner.dispatch(so)

    def _update_states(self, so: SchedulerOutput) -> None:
        self._leader.broadcast("step", wire.encode(so))
        self._inner._update_states(so)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def attach_leader(engine: Any, args: EngineArgs, *,
                  on_fatal: Callable[[str], None] = die) -> Leader | None:
    """On rank 0 of a multi-host run: accept the other ranks and make engine.step broadcast."""
    if args.num_hosts <= 1:
        return None
    if args.host_rank != 0:
        raise ConfigError("attach_leader runs on rank 0; other ranks run run_follower")
    host, port = control_address(args)
    leader = Leader(args.num_hosts, ("0.0.0.0" if host not in ("127.0.0.1", "localhost")
                                     else host, port),
                    timeout=args.multihost_timeout, on_fatal=on_fatal)
    engine.runner = BroadcastingRunner(engine.runner, leader)
    return leader


def run_follower(engine: Any, args: EngineArgs, *,
                 on_fatal: Callable[[str], None] = die) -> int:
    """Rank i > 0: run rank 0's steps until it says stop. Returns the number of steps."""
    follower = Follower(args.host_rank, control_address(args), timeout=args.multihost_timeout,
                        on_fatal=on_fatal)
    runner = engine.runner
    steps = 0
    log.info("multi-host: rank %d following rank 0", args.host_rank)
    try:
        while True:
            kind, payload = follower.recv()
            if kind == "stop":
                break
            if kind != "step":
                log.warning("multi-host: ignoring unexpected %r from rank 0", kind)
                continue
            so = wire.decode(payload)
            if so.is_empty:               # mirrors EngineCore.step exactly
                runner._update_states(so)
            else:
                runner.execute(so)
                steps += 1
    finally:
        follower.close()
    log.info("multi-host: rank %d stopped after %d steps", args.host_rank, steps)
    return steps


def follower_main(args: EngineArgs, *, model: tuple[Any, Any] | None = None) -> int:
    """Everything a rank > 0 does: load the model, build the engine, follow, shut down.

    `model` = (model_cfg, weights) skips loading (tests)."""
    from jaxserve.engine.core import EngineCore
    if model is None:
        from jaxserve.model.loader import load_model
        loaded = load_model(args.model, dtype=args.dtype)
        model = (loaded.config, loaded.weights)
    engine = EngineCore(args, model[0], model[1], progress=False)
    run_follower(engine, args)
    shutdown()
    return 0


def maybe_follow(args: EngineArgs) -> int | None:
    """CLI entry: join a multi-host run; on ranks > 0 follow rank 0 until it stops and
    return the exit code; on rank 0 (or one host) return None and carry on serving."""
    initialize(args)
    if args.num_hosts > 1 and args.host_rank != 0:
        return follower_main(args)
    return None


def shutdown() -> None:
    """Leave the multi-host run (a barrier with the other ranks)."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()
