"""Device meshes and multi-host start-up.

The mesh is always 2-D with axes ("data", "model"):

    devices (DP=2 x TP=4):      model ->
                          data  [[d0 d1 d2 d3]      replica 0 (its own scheduler + KV)
                            |    [d4 d5 d6 d7]]     replica 1

Tensor parallelism shards one model over a row; each row is a data-parallel replica
(core/data_parallel.py gives each row its own engine). Rows are contiguous in
device order, so on a multi-GPU host or a TPU slice a TP group shares the fastest links
(mesh_utils orders devices by topology where it knows it).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import ConfigError

log = logging.getLogger("jaxserve")

DATA, MODEL = "data", "model"


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, model) mesh of data_parallel_size x tensor_parallel_size devices."""
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ConfigError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
            f"{data_parallel_size} needs {need} devices; {len(devices)} are visible "
            f"({devices[0].platform if devices else 'none'}; on CPU set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} before starting)")
    devices = devices[:need]
    shape = (data_parallel_size, tensor_parallel_size)
    arr = None
    if devices[0].platform != "cpu":
        try:
            from jax.experimental import mesh_utils
            arr = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except Exception as e:  # unknown topology: plain device order is still correct
            log.debug("mesh_utils could not order devices (%s); using device order", e)
    if arr is None:
        arr = np.array(devices, dtype=object).reshape(shape)
    return Mesh(arr, (DATA, MODEL))


def mesh_shape_from(tensor_parallel_size: int, data_parallel_size: int,
                    mesh_section: Mapping[str, Any] | None, source: str = "config") -> tuple[int, int]:
    """(dp, tp) from the flags, or from a `mesh: {data: N, model: M}` config section.

    The flags win when they are given (not 1); a section that contradicts them is an error.
    """
    if not mesh_section:
        return data_parallel_size, tensor_parallel_size
    unknown = set(mesh_section) - {DATA, MODEL}
    if unknown:
        raise ConfigError(f"mesh section ({source}): unknown axes {sorted(unknown)}; "
                          f"use {DATA!r} and {MODEL!r}")
    dp = int(mesh_section.get(DATA, 1))
    tp = int(mesh_section.get(MODEL, 1))
    for flag, given, sec in (("tensor_parallel_size", tensor_parallel_size, tp),
                             ("data_parallel_size", data_parallel_size, dp)):
        if given != 1 and given != sec:
            raise ConfigError(f"{flag}={given} contradicts the mesh section ({source}): {sec}")
    return dp, tp


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, TP) sub-mesh per row of the data axis."""
    return [Mesh(mesh.devices[i:i + 1], mesh.axis_names) for i in range(mesh.devices.shape[0])]


def describe_mesh(mesh: Mesh) -> str:
    dims = " x ".join(f"{n}={s}" for n, s in mesh.shape.items())
    rows = ["[" + " ".join(str(d.id) for d in row) + "]" for row in mesh.devices]
    plat = mesh.devices.flat[0].platform
    procs = sorted({d.process_index for d in mesh.devices.flat})
    return f"{dims} on {mesh.devices.size} {plat} devices (ids {' '.join(rows)}; processes {procs})"


def init_distributed(num_hosts: int, host_rank: int, coordinator: str | None, *,
                     timeout_s: int = 60) -> None:
    """Join a multi-host run (jax's multi-controller runtime). No-op for one host.

    Must run before anything touches a device. On CPU, cross-process collectives use gloo.
    """
    if num_hosts <= 1:
        return
    if not coordinator or ":" not in coordinator:
        raise ConfigError(f"--num-hosts {num_hosts} needs --coordinator HOST:PORT (rank 0's "
                          f"address), got {coordinator!r}")
    if not 0 <= host_rank < num_hosts:
        raise ConfigError(f"--host-rank {host_rank} must be in [0, {num_hosts})")
    # Only affects the CPU backend (harmless next to GPUs/TPUs); CPU has no other
    # cross-process collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("multi-host: joining %s as rank %d of %d", coordinator, host_rank, num_hosts)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_hosts,
                               process_id=host_rank, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=max(10, timeout_s))
    log.info("multi-host: rank %d sees %d local / %d global devices", host_rank,
             jax.local_device_count(), jax.device_count())

