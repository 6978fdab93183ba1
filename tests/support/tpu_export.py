"""Lowering a Pallas kernel for TPU from this CPU host: Mosaic's lowering asks jax which
chip it targets, and there is none; `pretend_tpu_v5e` answers a v5e for the test (undone
by monkeypatch after it), or skips if jax's internals no longer have the registry."""
from __future__ import annotations

from typing import Any

import jax
import pytest


def pretend_tpu_v5e(monkeypatch: Any) -> None:
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry"):
        pytest.skip("jax internals changed: no TPU info registry to patch")
    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                        lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
