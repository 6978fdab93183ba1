"""Where jaxserve keeps what it makes once and reuses: converted models, XLA's compile
cache, the CPU kernel library. One rule for all of them, so one setting moves them."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "JAXSERVE_CACHE"


def cache_root(root: str | Path | None = None) -> Path:
    """`root`, else $JAXSERVE_CACHE, else ~/.cache/jaxserve."""
    if root is None:
        root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxserve"
    return Path(root)
