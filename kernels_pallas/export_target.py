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
def cuda(device_kind: str = H100, num_sms: int = H100_SMS) -> Iterator[None]:
    """Lower for CUDA as if `device_kind` (with `num_sms` SMs) were the local GPU."""
    if jax.devices()[0].platform == "gpu":
        yield
        return
    mesh = jax.sharding.AbstractMesh((1,), ("export",),
                                     abstract_device=abstract_gpu(device_kind, num_sms))
    with jax.sharding.use_abstract_mesh(mesh):
        yield
