"""Run Python code in a subprocess where the server's and the structured-output stack's
packages cannot be imported, as on an accelerator image that lacks them: the code sees
an ImportError for each. Each attempt is reported on stderr at once ("IMPORT BLOCKED:
name"), and the process prints the names tried when it ends normally ("TRIED [...]"; a
process that leaves through os._exit prints only the former)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ["fastapi", "uvicorn", "gguf", "llguidance", "outlines_core", "outlines"]
GUARD = f"""
import atexit, sys
tried = []
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            tried.append(name)
            sys.stderr.write("IMPORT BLOCKED: " + name + "\\n")
            raise ImportError("blocked on the accelerator image: " + name)
        return None
sys.meta_path.insert(0, Block())
atexit.register(lambda: print("TRIED", sorted(set(tried)), flush=True))
"""
# `python -m jaxserve.tools.device_check` (its console kept in log.txt, then os._exit)
DEVICE_CHECK = """
from jaxserve.tools import device_check
device_check.cli(sys.argv[1:])
"""


def run_server_free(code: str, *args: str, timeout: int,
                    env: dict[str, Any] | None = None) -> subprocess.CompletedProcess:
    """`code` with argv `args` on the CPU backend, default XLA flags, offline."""
    full = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", **(env or {}))
    full.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-c", GUARD + code, *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)
