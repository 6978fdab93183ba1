"""jaxserve.tools.device_check end to end on the CPU (--smoke: tiny shapes, Pallas interpret
mode): every section runs, the kernels agree with the float64 reference (the int8
matmul with its float32 one), the engine's fused step decodes without recompiling, none of
the server's packages is imported, and one failing measurement leaves the others."""
from __future__ import annotations

import json
import os

import pytest
from server_free import DEVICE_CHECK, run_server_free


def _with_test_xla_flags(code: str) -> str:
    """`code` compiling with this process's XLA flags: the suite's (tests/conftest.py: no
    expensive LLVM passes, unless JAXSERVE_TEST_XLA_DEFAULTS=1), which change how fast
    the generated code runs, not what it computes. The run compiles every program into
    an empty cache, and at XLA's default optimisation those compiles were most of this
    test's time. A simulated device count is not passed on: the smoke runs on one
    device, as by hand. (run_server_free drops the XLA_FLAGS it is given.)"""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return f"import os\nos.environ['XLA_FLAGS'] = {flags!r}\n" + code


def test_smoke_runs_every_section_and_writes_json_markdown_and_log(tmp_path, monkeypatch):
    """Without the server packages, as on an accelerator image (server_free)."""
    monkeypatch.delenv("JAXSERVE_CACHE", raising=False)
    # A generous budget: on a busy CI machine no workload may be skipped for time.
    proc = run_server_free(_with_test_xla_flags(DEVICE_CHECK), "--smoke", "--budget", "400",
                           "--cache", str(tmp_path / "cache"), env={"OUT": str(tmp_path)},
                           timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "IMPORT BLOCKED" not in proc.stderr, proc.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"][0]["smoke"] is True
    assert res["copy"][0]["ok"] and res["copy"][0]["gbps"] > 0
    kernels = {(r["name"], r["impl"]): r for r in res["kernels"]}
    assert set(kernels) == {(n, i) for n in ("4x64", "1x64") for i in ("ours", "splitk", "jax")
                            } | {("mixed", "ours")}
    assert kernels[("4x64", "splitk")]["kernel"] == \
        "ragged_paged_attention_splitk({'num_splits': 2})"
    for r in kernels.values():        # float32 vs the float64 reference
        assert r["ok"] and r["rel_err"] < 1e-5 and r["ref_std"] > 0.1, r
        assert r["block_drop"] == [] and r["us"] > 0 and r["bytes"] > 0
    # 1x64 runs padded to 4x64's shapes: no compile of its own
    assert all(kernels[("1x64", i)]["compiled"] is False for i in ("ours", "splitk", "jax"))
    assert all(kernels[("4x64", i)]["compiled"] is True for i in ("ours", "splitk", "jax"))
    quant = {(r["name"], r["impl"]): r for r in res["quant"]}    # interpret mode
    assert set(quant) == {("200x300 m=3", i) for i in ("kernel", "xla_int8", "float_dot")} | {
        ("q4_k 200x512 m=3", i) for i in ("kernel", "xla")}
    assert all(r["ok"] and r["rel_err"] < 1e-5 and r["us"] > 0 for r in quant.values())
    engine = {r["name"]: r for r in res["engine"]}
    assert set(engine) == {"4x64", "1x64"}
    for r in engine.values():
        assert r["ok"] and r["recompiles"] == 0 and r["step_ms"] > 0, r
        assert r["first_step_s"] > 0 and r["dispatch_ms"] >= 0
    md = (tmp_path / "results.md").read_text()
    assert "| 4x64 | ours |" in md and "| 1x64 | (4, 8) |" in md
    log = (tmp_path / "log.txt").read_text()        # the console, kept beside the results
    assert '"section": "engine"' in log and "PASS: " in log
    assert (tmp_path / "cache" / "xla").is_dir()
    # the smoke engine runs XLA's dot, as on an accelerator: no C++ kernel library built
    assert not (tmp_path / "cache" / "kernels").exists()


def test_a_failing_measurement_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch):
    from jaxserve.tools import device_check, device_check_attention

    def broken(case, interpret):
        raise RuntimeError("no such kernel here")
    monkeypatch.setattr(device_check_attention, "jax_paged", broken)
    # main() points $JAXSERVE_CACHE and jax's compilation cache at its --cache for the
    # rest of the process: give it the suite's own, so the tests after this one in the
    # same worker keep their built C++ kernels and compiled programs
    from jaxserve.paths import cache_root
    cache = str(cache_root())
    monkeypatch.setenv("JAXSERVE_CACHE", cache)
    code = device_check.main(["--smoke", "--sections", "kernels", "--budget", "400",
                              "--out", str(tmp_path), "--cache", cache])
    assert code == 1
    rows = json.loads((tmp_path / "results.json").read_text())["kernels"]
    ours = [r for r in rows if r["impl"] == "ours"]
    theirs = [r for r in rows if r.get("error")]
    assert len(ours) == 3 and all(r["ok"] for r in ours)
    assert len(theirs) == 2 and all("no such kernel here" in r["error"] for r in theirs)
    assert "no such kernel here" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("kind,peak", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                       ("TPU v5 lite", 0.819e12), ("cpu", None)])
def test_peak_bandwidth_by_device_kind(kind, peak):
    from jaxserve.tools import device_check
    assert device_check.peak_bandwidth(kind, None) == peak
    assert device_check.peak_bandwidth(kind, 1000.0) == 1e12


def test_a_step_past_the_deadline_is_skipped_not_waited_for(tmp_path):
    """A compile or loop that cannot finish before the deadline is abandoned: the row is
    recorded as skipped within the budget and the run goes on."""
    import time
    from jaxserve.tools.device_check_run import Run, guarded
    run = Run(smoke=True, out=tmp_path, budget_s=1.5, iters=1, peak_bw=None, dtype=None)
    t = time.monotonic()
    guarded(run, "kernels", "slow", 0.0, lambda: run.bounded("compile", lambda: time.sleep(30)))
    guarded(run, "kernels", "late", 0.0, lambda: {"ok": True})
    assert time.monotonic() - t < 3
    slow, late = run.results["kernels"]
    assert slow["skipped"] and not slow["ok"] and "compile" in slow["error"]
    assert late["skipped"] and run.abandoned == 1
    assert "skipped" in (tmp_path / "results.md").read_text()
