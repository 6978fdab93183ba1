"""Optional packages: import them where needed, or fail with one line that names the fix.

    httpx = require("httpx", extra="bench")
        -> the module, or MissingDependencyError("jaxserve bench serve needs the package
           'httpx': pip install 'jaxserve[bench]'")

The runtime install (`pip install jaxserve`, `make venv`) carries what `serve`, `generate`
and `convert` need; benchmark-only packages come with the `bench` extra, the transformers
reference (torch) only with `test`.
"""
from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependencyError(ImportError):
    """An optional package is not installed; the message says which extra brings it."""


def require(module: str, *, extra: str, feature: str = "this feature",
            package: str | None = None) -> ModuleType:
    """Import `module`, or raise MissingDependencyError naming the package and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but something inside it is broken: show that
        pkg = package or module.split(".")[0]
        raise MissingDependencyError(
            f"{feature} needs the package {pkg!r}, which is not installed: "
            f"pip install 'jaxserve[{extra}]' (or pip install {pkg})") from e
