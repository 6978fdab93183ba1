"""One model over several hosts: rank 0 schedules, every rank runs the same step in lockstep.

    rank 0: HTTP / LLM -> EngineCore.step: schedule -> [broadcast SchedulerOutput] -> execute
    rank i:              Follower loop:            [receive SchedulerOutput] -> execute

JAX's multi-controller runtime needs every process to launch the same jitted step with
the same inputs; the step's collectives then run across hosts. Everything that shapes
a step is a deterministic function of the SchedulerOutput sequence (the runner's
request states, block table, padded batch, sampler state, the step's RNG key from the
step count), so rank 0 sends only that, encoded with core/multihost/codec.py (typed msgpack)
over core/multihost/control.py's channel, which also turns a dead or hung rank into a clear
error on every other rank (no hang).

Start-up on every host (before anything touches a device):

    initialize(args)                      # jax.distributed.initialize (+ gloo on CPU)
    engine = EngineCore(args, cfg, weights)   # same args everywhere: same mesh, warm-up
    rank 0:  leader = attach_leader(engine, args); ...serve...; leader.stop(); shutdown()
    rank i:  run_follower(engine, args); shutdown()      (follower_main does all of it)

The CLI needs three lines: `code = maybe_follow(args)` first (returns at once on rank 0),
then on rank 0 `leader = attach_leader(llm.engine, args)` and at exit `leader.stop()`.

The control channel authenticates ranks with a per-run key (session_key): an HMAC of a
random salt that rank 0 sends to every rank through JAX's own collectives, keyed with
the configured secret (--multihost-secret-file, else $JAXSERVE_MULTIHOST_SECRET, else
empty). Every rank runs the same broadcast whatever is configured, so a rank with a
different (or no) secret fails the handshake with a clear error instead of hanging.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import stat
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

import jax

from jaxserve.config import ConfigError, EngineArgs
from jaxserve.core.multihost import codec as wire
from jaxserve.core.multihost.control import Follower, Leader, die
from jaxserve.parallel.mesh import init_distributed
from jaxserve.core.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from jaxserve.core.client import EngineClient
    from jaxserve.core.engine_core import EngineCore

log = logging.getLogger("jaxserve")

SECRET_ENV = "JAXSERVE_MULTIHOST_SECRET"


def control_address(args: EngineArgs) -> tuple[str, int]:
    """Rank 0's control channel: the coordinator's host, the coordinator's port + 1."""
    if not args.coordinator or ":" not in args.coordinator:
        raise ConfigError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    host, port = args.coordinator.rsplit(":", 1)
    return host, int(port) + 1


def configured_secret(args: EngineArgs) -> bytes:
    """--multihost-secret-file's content, else $JAXSERVE_MULTIHOST_SECRET, else b""."""
    if args.multihost_secret_file:
        path = Path(args.multihost_secret_file)
        try:
            secret = path.read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"--multihost-secret-file {path}: {e.strerror}") from None
        if not secret:
            raise ConfigError(f"--multihost-secret-file {path} is empty")
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("multi-host: %s is readable by other users (chmod 600 it)", path)
        return secret
    return os.environ.get(SECRET_ENV, "").encode()


def session_key(args: EngineArgs) -> bytes:
    """The control channel's key for this run; every rank must call it at the same point
    (it is a collective). Without a configured secret the key is only as private as the
    salt's path (the devices' interconnect; gloo's TCP connections on CPU)."""
    from jax.experimental import multihost_utils
    secret = configured_secret(args)
    if not secret:
        log.warning("multi-host: no shared secret (%s or --multihost-secret-file); the "
                    "control channel's key travels over JAX's collectives - set a secret "
                    "on networks you do not trust (docs/parallel.md)", SECRET_ENV)
    salt = np.frombuffer(os.urandom(32), np.uint8).astype(np.int32)
    if jax.process_index() != 0:
        salt = np.zeros_like(salt)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(salt)).astype(np.uint8)
    return hmac.new(secret, b"jaxserve-multihost-session|" + shared.tobytes(),
                    hashlib.sha256).digest()


def bind_address(host: str) -> str:
    """Rank 0 listens on the coordinator's own interface only (never 0.0.0.0): the
    address the other ranks dial is the one address that must accept them."""
    try:
        addr = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as e:
        raise ConfigError(f"--coordinator host {host!r} does not resolve: {e}") from None
    if ipaddress.ip_address(addr).is_loopback and not _names_loopback(host):
        # e.g. Debian maps the machine's own name to 127.0.1.1 in /etc/hosts
        raise ConfigError(f"--coordinator host {host!r} resolves to the loopback address "
                          f"{addr} on rank 0, which other hosts cannot reach; give rank 0's "
                          f"IP address in --coordinator")
    return addr


def _names_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def initialize(args: EngineArgs) -> None:
    """Join the multi-host run described by args (no-op for one host)."""
    init_distributed(args.num_hosts, args.host_rank, args.coordinator,
                     timeout_s=int(max(60, args.multihost_timeout)))


class BroadcastingRunner:
    """Rank 0's runner: sends each SchedulerOutput to the other ranks, then runs it, and
    says when it collects a step, so that every rank dispatches and collects in the same
    order. The runner's state (e.g. whether a decode row's token comes from the host or
    is fed on the device from the last step) depends on that interleaving, which
    EngineCore.step varies (asynchronous scheduling dispatches step N+1 before
    collecting step N); every rank must build the same batch from it."""

    def __init__(self, inner: Any, leader: Leader) -> None:
        self._inner = inner
        self._leader = leader

    def execute(self, so: SchedulerOutput) -> Any:
        return self.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput) -> Any:
        self._leader.broadcast("step", wire.encode(so))
        return self._inner.dispatch(so)

    def collect(self, step: Any) -> Any:
        """Steps are collected oldest first on every rank."""
        self._leader.broadcast("collect")
        return self._inner.collect(step)

    def update_states(self, so: SchedulerOutput) -> None:
        self._leader.broadcast("step", wire.encode(so))
        self._inner.update_states(so)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def attach_leader(engine: EngineClient, args: EngineArgs, *,
                  on_fatal: Callable[[str], None] = die) -> Leader | None:
    """On rank 0 of a multi-host run: accept the other ranks and make engine.step broadcast."""
    from jaxserve.core.engine_core import EngineCore
    if args.num_hosts <= 1:
        return None
    if args.host_rank != 0:
        raise ConfigError("attach_leader runs on rank 0; other ranks run run_follower")
    if not isinstance(engine, EngineCore):
        raise ConfigError("a multi-host run drives one EngineCore (no data parallelism)")
    host, port = control_address(args)
    bind = (bind_address(host), port)
    key = session_key(args)
    leader = Leader(args.num_hosts, bind, secret=key,
                    timeout=args.multihost_timeout, on_fatal=on_fatal)
    engine.runner = BroadcastingRunner(engine.runner, leader)   # type: ignore[assignment]
    return leader


def run_follower(engine: EngineCore, args: EngineArgs, *,
                 on_fatal: Callable[[str], None] = die) -> int:
    """Rank i > 0: run rank 0's steps until it says stop. Returns the number of steps."""
    key = session_key(args)
    follower = Follower(args.host_rank, control_address(args), secret=key,
                        timeout=args.multihost_timeout, on_fatal=on_fatal)
    runner = engine.runner
    steps = 0
    inflight: deque[Any] = deque()        # dispatched, not yet collected (oldest first)
    log.info("multi-host: rank %d following rank 0", args.host_rank)
    try:
        while True:
            kind, payload = follower.recv()
            if kind == "stop":
                break
            if kind == "collect":         # rank 0 collected its oldest step: so do we
                runner.collect(inflight.popleft())
                continue
            if kind != "step":
                log.warning("multi-host: ignoring unexpected %r from rank 0", kind)
                continue
            so = wire.decode(payload)
            if so.is_empty:               # mirrors EngineCore.step exactly
                runner.update_states(so)
            else:
                inflight.append(runner.dispatch(so))
                steps += 1
    finally:
        follower.close()
    log.info("multi-host: rank %d stopped after %d steps", args.host_rank, steps)
    return steps


def follower_main(args: EngineArgs, *, model: tuple[Any, Any] | None = None) -> int:
    """Everything a rank > 0 does: load the model, build the engine, follow, shut down.

    `model` = (model_cfg, weights) skips loading (tests)."""
    from jaxserve.core.engine_core import EngineCore
    if model is None:
        from jaxserve.model.loader.load import load_model
        loaded = load_model(args.model, dtype=args.dtype, shardings=weight_shardings(args),
                            quantization=args.quantization)
        model = (loaded.config, loaded.weights)
    engine = EngineCore(args, model[0], model[1], progress=False)
    run_follower(engine, args)
    shutdown()
    return 0


def weight_shardings(args: EngineArgs) -> Callable[[Any], Any] | None:
    """Across hosts: (model config) -> the mesh's sharding per weight, so that an orbax
    checkpoint is restored in place, each host reading only its own devices' slices
    (restoring into the saving machine's topology fails on every other host). Every rank
    builds the same mesh from the same args, so the shardings agree with the engine's."""
    if args.num_hosts <= 1:
        return None

    def shardings(cfg: Any) -> Any:
        from jaxserve.parallel.shard import ShardingPlan, mesh_and_rules_from_args
        found = mesh_and_rules_from_args(args)
        assert found is not None                  # num_hosts > 1 always has a mesh
        return ShardingPlan.build(cfg, *found, log_summary=False).param_shardings()
    return shardings


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
