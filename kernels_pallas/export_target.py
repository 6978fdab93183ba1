"""Lowering the kernels for an accelerator from a host that has none (jax.export).

    with export_target.cuda():
        jax.export.export(fn, platforms=["cuda"])(*shapes)

Pallas' Triton lowering asks the GPU for its compute capability. jax 0.10 falls back
to a default when the host has no GPU; jax 0.11 raises "No supported GPU devices
found, please specify an abstract GPU device using AbstractDevice" instead. `cuda()`
declares that device: an abstract mesh (jax.sharding.use_abstract_mesh) whose
AbstractDevice names the target GPU, which both releases accept. Where a GPU is
attached, the context adds nothing (the real device answers).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import jax

H100 = "NVIDIA H100 80GB HBM3"
H100_SMS = 132


def abstract_gpu(device_kind: str = H100, num_sms: int = H100_SMS) -> jax.sharding.AbstractDevice:
    return jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_sms,
                                       platform="gpu")


@contextlib.contextmanager
def cuda(device_kind: str = H100, num_sms: int = H100_SMS, *,
         sharded: bool = False) -> Iterator[None]:
    """Lower for CUDA as if `device_kind` (with `num_sms` SMs) were the local GPU.

    sharded: the traced function runs shard_map over a concrete (CPU) mesh, which must
    equal the context mesh, so no abstract GPU mesh can be entered; instead the Triton
    lowering's table of known device kinds (a jax internal, absent before 0.11, where
    nothing is needed) maps this host's device kind to the target for the duration.
    """
    if jax.devices()[0].platform == "gpu":
        yield
        return
    if sharded:
        with _known_device_kind(device_kind):
            yield
        return
    # Auto axes: arrays sharded over a concrete mesh of Auto axes may trace inside it
    mesh = jax.sharding.AbstractMesh((1,), ("export",),
                                     axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=abstract_gpu(device_kind, num_sms))
    with jax.sharding.use_abstract_mesh(mesh):
        yield


@contextlib.contextmanager
def _known_device_kind(device_kind: str) -> Iterator[None]:
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        gpu_info = None
    registry = getattr(gpu_info, "registry", None)
    version = gpu_info and gpu_info.gpu_version_from_device_kind(device_kind)
    if registry is None or version is None:
        yield
        return
    local = jax.devices()[0].device_kind
    saved = registry.get(local)
    registry[local] = lambda: gpu_info.get_gpu_info_from_version(version)
    try:
        yield
    finally:
        if saved is None:
            registry.pop(local, None)
        else:
            registry[local] = saved
