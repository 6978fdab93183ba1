"""`jaxserve tools <name>`: the developer tools behind the main command, and what stays
out of it (the stress suite's fault-injecting server)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.cli import build_parser
from jaxserve.tools import TOOLS

ROOT = Path(__file__).resolve().parents[2]


def test_every_tool_is_a_module_with_a_main() -> None:
    import importlib
    for name, module in TOOLS.items():
        assert callable(importlib.import_module(f"jaxserve.tools.{module}").main), name


def test_fault_hooks_are_not_reachable_from_the_command() -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["tools", "stress-server"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--stress-wedge-token", "42"])
    ns = parser.parse_args(["tools", "export-check", "--platform", "cuda", "--tp", "2"])
    assert ns.tool == "export-check" and ns.tool_args == ["--platform", "cuda", "--tp", "2"]


def test_export_check_through_the_command_gets_its_simulated_devices() -> None:
    """The tool sets XLA_FLAGS before jax is imported: the command must not import jax
    first, or a TP=2 export finds one device."""
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "tools", "export-check",
                           "--platform", "cuda", "--shape", "smollm2", "--tp", "2",
                           "--max-buckets", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if not l.startswith("#")]
    assert len(lines) == 1 and re.match(r"OK cuda tokens=\d+ width=\d+ kernel_calls=30",
                                        lines[0]), lines
