"""Warm-up program counts of the shipped H200 config (jaxserve/tools/count_programs.py):
one forward program per token bucket and one branch-free sampler per sampler row count;
prompt logprobs are not compiled at warm-up."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.warmup
def test_h200_config_compiles_at_most_15_programs_at_warm_up(monkeypatch):
    from jaxserve.tools import count_programs
    from jaxserve.worker import step_config
    monkeypatch.setattr(step_config, "step_platform", step_config.step_platform)  # restored
    got = count_programs.count(ROOT / "configs" / "gpu_h200_llama3-8b.yaml", "gpu")
    assert got["shapes"] == len(got["token_buckets"]) == 11
    assert got["sampler_rows"] == [8, 64, 256] and got["sampler_plans"] == 1
    assert got["programs"] == got["shapes"] + len(got["sampler_rows"]) == 14
