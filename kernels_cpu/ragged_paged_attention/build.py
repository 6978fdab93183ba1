"""Compile kernel.cc once per (source, jaxlib, compiler, CPU) into the jaxserve cache and
register it as an XLA FFI target for the CPU platform.

    load() -> target name            (raises KernelUnavailable with the reason)

The shared library is cached as <cache>/kernels/<name>-<hash>.so, so only the first
use on a machine pays the compile (~10 s); it is written to a temporary file and
renamed into place, so concurrent first uses are safe. Built with -march=native, hence
the CPU's flags are part of the hash. Process-wide float state is left alone (no
-ffast-math: see library_path).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger("jaxserve")

TARGET = "jaxserve_ragged_paged_attention_f32"
SYMBOL = "JaxserveRaggedPagedAttentionF32"
SOURCE = Path(__file__).with_name("kernel.cc")
_lock = threading.Lock()
_loaded: str | None = None


class KernelUnavailable(RuntimeError):
    """No C++ compiler, or the kernel did not build: use the jnp reference instead."""


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown-cpu"
    flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    model = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    return model + flags


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") \
        or shutil.which("clang++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler found (set CXX or install g++)")
    return cxx


def library_path(cache_dir: Path) -> tuple[Path, list[str]]:
    cxx = _compiler()
    # Not -ffast-math: linking a shared object with it pulls in crtfastmath, which sets
    # flush-to-zero for the whole process when the library loads. Only the flags the
    # vectorized reductions need:
    cmd = [cxx, "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
           "-fassociative-math", "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC",
           "-pthread", f"-I{jax.ffi.include_dir()}", str(SOURCE)]
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(cmd).encode(),
                 _cpu_signature().encode()):
        h.update(part)
    return cache_dir / "kernels" / f"ragged_paged_attention-{h.hexdigest()[:16]}.so", cmd


def _build(path: Path, cmd: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    log.info("compiling the CPU attention kernel -> %s", path)
    try:
        res = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(cache_dir: Path | None = None) -> str:
    """Build if needed, load, register; idempotent. Returns the FFI target name."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if cache_dir is None:
            from jaxserve.model.loader.default_model import cache_root
            cache_dir = cache_root()
        path, cmd = library_path(Path(cache_dir))
        if not path.exists():
            _build(path, cmd)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)),
                                    platform="cpu")
        _loaded = TARGET
        return TARGET
