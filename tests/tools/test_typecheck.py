"""mypy over jaxserve/ (config: [tool.mypy] in pyproject.toml) must pass, and must catch
the bug class it is there for: an engine that does not implement EngineClient, or a
front end that reaches past the interface (the `core.kv_manager` read that made
`serve --data-parallel-size 2` die at start). Part of `make lint`, not of `make test`: the
root conftest collects this file only when it is named."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mypy(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-pretty", *extra], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_mypy_passes_on_jaxserve():
    r = _mypy(ROOT)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Success" in r.stdout


def _mutate(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {path}"
    path.write_text(text.replace(old, new))


def test_mypy_fails_when_an_engine_or_a_front_end_breaks_the_interface(tmp_path: Path):
    shutil.copytree(ROOT / "jaxserve", tmp_path / "jaxserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = tmp_path / "jaxserve"
    # 1. DataParallelEngine loses a method of the protocol.
    _mutate(pkg / "core" / "data_parallel.py", "    def snapshot(self) -> EngineSnapshot:",
            "    def snapshot_gone(self) -> EngineSnapshot:")
    # 2. The async engine reads the scheduler of "its engine", which may be several.
    with open(pkg / "frontend" / "async_engine.py", "a") as f:
        f.write("\n\ndef _reaches_in(engine: AsyncEngine) -> int:\n"
                "    return engine.core.scheduler.num_waiting\n")
    r = _mypy(tmp_path, "--cache-dir", str(tmp_path / "cache"))
    out = r.stdout
    assert r.returncode == 1, out[-4000:] + r.stderr[-2000:]
    assert "data_parallel.py" in out and '"DataParallelEngine"' in out and "snapshot" in out, out
    assert 'async_engine.py' in out and '"EngineClient" has no attribute "scheduler"' in out, out
