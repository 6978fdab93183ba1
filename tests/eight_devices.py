"""Test modules that need 8 simulated CPU devices rerun themselves in a subprocess.

XLA_FLAGS must be set before jax is imported, so under a normal `pytest tests` run such
a module defines one outer test that runs the whole module again with 8 devices; the
real tests run there (or directly: XLA_FLAGS=--xla_force_host_platform_device_count=8
pytest tests/<module>). Usage:

    from eight_devices import INNER, run_module
    if not INNER:
        def test_suite_on_eight_devices() -> None:
            run_module(__file__, "fused-step tests", timeout=1500)
    else:
        ...the tests...
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FLAG = "--xla_force_host_platform_device_count=8"
INNER = FLAG in os.environ.get("XLA_FLAGS", "")


def run_module(path: str, what: str, timeout: float = 900) -> None:
    """Run the test module at `path` with 8 CPU devices; fail with its output if it fails."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip(),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path],
        cwd=Path(path).resolve().parents[1], env=env, capture_output=True, text=True,
        timeout=timeout)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"8-device {what} failed (output above)"
