"""JAX's persistent compilation cache, kept in the jaxserve cache directory."""
from __future__ import annotations

import logging
from pathlib import Path

import jax

from jaxserve.paths import cache_root

log = logging.getLogger("jaxserve")
_enabled: Path | None = None


def enable_compilation_cache(root: str | Path | None = None) -> Path:
    """Point XLA's persistent cache at <jaxserve cache>/xla (idempotent).

    Every executable is cached (no minimum compile time), so a second start of the
    same configuration loads its buckets instead of compiling them.
    """
    global _enabled
    path = cache_root(root) / "xla"
    if _enabled == path:
        return path
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = path
    log.info("XLA compilation cache: %s", path)
    return path
