"""Several runs of the export tool (jaxserve.tools.export_check) in one spawned process:
start-up, jax's import and the tool's set-up are most of a small export's cost.

Simulated devices need XLA_FLAGS before jax is imported, so the runs share a process of
their own, which imports nothing of jax before the first run: that run's main() sets
the device count (as the tool's command line does), so it must be the one that needs the
most devices; later runs build their meshes from the first TP x DP of those devices, as
the tool does on a host with more devices than it needs. A run that raises is reported
as failed and the others still run.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_DRIVER = """
import json, sys, traceback
from jaxserve.tools import export_check
for name, argv in json.loads(sys.argv[1]).items():
    print(f"@@@ start {name}", flush=True)
    try:
        rc = export_check.main(argv)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        rc = 1
    print(f"@@@ end {name} rc={rc}", flush=True)
"""


def run_exports(runs: dict[str, list[str]], timeout: float
                ) -> dict[str, tuple[int, list[str]]]:
    """{name: the tool's arguments} -> {name: (its exit status, its output lines)}."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(runs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {m.group(1): (int(m.group(3)), m.group(2).splitlines()) for m in re.finditer(
        r"^@@@ start (\S+)\n(.*?)^@@@ end \1 rc=(\d+)$", proc.stdout, re.M | re.S)}
    assert list(out) == list(runs), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out
