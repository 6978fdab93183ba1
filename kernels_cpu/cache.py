"""The folder the CPU kernel library is built into when the caller names none. The
kernels import nothing from jaxserve, so they keep their own copy of its rule
(jaxserve/paths.py: cache_root; tests/unit/test_layering.py checks that the two agree)."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "JAXSERVE_CACHE"


def cache_root() -> Path:
    """$JAXSERVE_CACHE, else ~/.cache/jaxserve."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxserve")
