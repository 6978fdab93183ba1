"""`jaxserve bench sweep` and `bench latency` on a tiny random Llama.

One 2-point sweep (prefix caching off/on over a shared-prefix workload) runs once per
module; its engines are small (2 compiled shapes each). The truth: cached prompt tokens
appear only where caching is on, the files agree with each other and with the workload,
and latency statistics match hand-computed values.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine_utils import tiny_config, tiny_tokenizer, tiny_weights
from jaxserve.bench.latency import request_latency_stats, run_latency
from jaxserve.bench.sweep import load_ablation, run_sweep
from jaxserve.cli import main as cli_main
from jaxserve.config import ConfigError
from jaxserve.frontend.llm import LLM

# the sweep and the latency bench report compiles after warm-up: their engines warm up
pytestmark = pytest.mark.warmup

REPO = Path(__file__).resolve().parents[2]
# 4 requests of 32 shared + 8 own tokens under a 32-token budget: the first request's
# prefix blocks are cached before the others are scheduled, so caching must hit.
SWEEP_YAML = """
description: tiny prefix caching sweep
workload: {name: shared_prefix, num_prompts: 4, prefix_len: 32, suffix_len: 8,
           output_len: 4, seed: 3}
base: {max_model_len: 64, max_num_seqs: 8, max_num_batched_tokens: 32, token_buckets: [32]}
grid:
  enable_prefix_caching: [false, true]
repeats: 2
"""


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    (tmp / "tiny.yaml").write_text(SWEEP_YAML)
    cfg = tiny_config()
    weights, tok = tiny_weights(cfg), tiny_tokenizer()
    engines = []

    def make_llm(settings):      # the test hook: in-memory weights instead of a model path
        engines.append(LLM.from_weights(cfg, weights, tok, **settings))
        return engines[-1]

    spec = load_ablation(tmp / "tiny.yaml")
    result = run_sweep(spec, tmp / "out", make_llm=make_llm, progress=False)
    return SimpleNamespace(out=tmp / "out", result=result, engines=engines)


def test_sweep_runs_each_point_on_a_fresh_engine(sweep):
    assert len(sweep.engines) == 2
    assert [e.args.enable_prefix_caching for e in sweep.engines] == [False, True]
    assert all(e.args.max_num_batched_tokens == 32 for e in sweep.engines)


def test_sweep_json(sweep):
    data = json.loads((sweep.out / "results.json").read_text())
    assert data["spec"]["grid"] == {"enable_prefix_caching": [False, True]}
    assert data["spec"]["workload"]["seed"] == 3
    off, on = data["points"]
    assert off["point"] == {"enable_prefix_caching": False}
    for p in (off, on):
        assert "error" not in p
        assert len(p["runs"]) == 2
        assert p["workload"] == {"name": "shared_prefix", "requests": 4, "prompt_tokens": 160,
                                 "output_len": 4}
        for run in p["runs"]:
            assert run["output_tokens"] == 16 and run["recompiles"] == 0
            assert run["mean_ttft_ms"] <= run["mean_e2el_ms"]
        assert p["metrics"]["output_tokens_per_s"] == pytest.approx(
            float(np.median([r["output_tokens_per_s"] for r in p["runs"]])))
    assert off["metrics"]["cached_prompt_tokens"] == 0
    # the prefix cache is reset before every run, so both runs hit the same amount: the
    # 2 full 16-token prefix blocks for each of the 3 later requests
    assert [r["cached_prompt_tokens"] for r in on["runs"]] == [96, 96]


def test_sweep_csv_and_markdown(sweep):
    with open(sweep.out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["enable_prefix_caching"] for r in rows] == ["False", "True"]
    for r in rows:
        assert float(r["output_tokens_per_s"]) > 0
        assert float(r["mean_tpot_ms"]) > 0 and not math.isnan(float(r["p99_ttft_ms"]))
        assert r["error"] == ""
    md = (sweep.out / "results.md").read_text()
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| enable_prefix_caching | output tok/s |")
    assert len(lines) == 4 and lines[2].startswith("| False |") and lines[3].startswith("| True |")
    assert "tiny prefix caching sweep" in md and "seed=3" in md


def test_sweep_plots_exist(sweep):
    for name in ("tradeoff.png", "knob_enable_prefix_caching.png"):
        data = (sweep.out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_latency_bench(sweep):
    res = run_latency(sweep.engines[1], batch_size=3, input_len=10, output_len=5,
                      num_iters=3, num_iters_warmup=1)
    assert len(res["latencies"]) == 3 and res["recompiles"] == 0
    assert res["avg_latency"] == pytest.approx(sum(res["latencies"]) / 3)
    ps = [res["percentiles"][p] for p in ("10", "25", "50", "75", "90", "99")]
    assert min(res["latencies"]) <= ps[0] and ps == sorted(ps) and ps[-1] <= max(res["latencies"])
    assert res["percentiles"]["50"] == pytest.approx(sorted(res["latencies"])[1])


def test_request_latency_stats_hand_computed():
    def out(arrival, first, finished, n):
        m = SimpleNamespace(arrival_time=arrival, first_token_time=first, finished_time=finished)
        return SimpleNamespace(metrics=m, outputs=[SimpleNamespace(token_ids=[0] * n)])
    # TTFT 0.1 and 0.3 s; E2EL 0.5 and 0.7 s; TPOT (0.5-0.1)/4 = 0.1, (0.7-0.3)/2 = 0.2 s
    stats = request_latency_stats([out(0.0, 0.1, 0.5, 5), out(1.0, 1.3, 1.7, 3),
                                   out(2.0, 2.2, 2.2, 1)])   # 1 token: no TPOT
    assert stats["mean_ttft_ms"] == pytest.approx(200.0)
    assert stats["median_ttft_ms"] == pytest.approx(200.0)
    assert stats["mean_tpot_ms"] == pytest.approx(150.0)
    assert stats["p99_tpot_ms"] == pytest.approx(100.0 + 0.99 * 100.0)
    assert stats["mean_e2el_ms"] == pytest.approx((500 + 700 + 200) / 3)


# ---- ablation config validation (no engines) ------------------------------------------
def _write(tmp_path, text):
    p = tmp_path / "abl.yaml"
    p.write_text(text)
    return p


GOOD = "workload: {name: shared, num_prompts: 2}\ngrid: {block_size: [16, 32]}\n"


@pytest.mark.parametrize("text, needle", [
    (GOOD + "repeat: 2\n", "unknown key 'repeat'"),
    (GOOD + "base: {max_num_seq: 4}\n", "unknown engine setting 'max_num_seq' under base"),
    ("workload: {name: shared}\ngrid: {blocksize: [16]}\n", "'blocksize' under grid"),
    ("workload: {name: shared, num_prompt: 2}\ngrid: {block_size: [16]}\n",
     "unknown key 'num_prompt' under workload"),
    ("workload: {name: nope}\ngrid: {block_size: [16]}\n", "workload.name: 'nope'"),
    ("workload: {name: [x]}\ngrid: {block_size: [16]}\n", "workload.name: ['x']"),
    (GOOD + "base: [1]\n", "base: expected a mapping"),
    ("workload: {name: shared}\ngrid: {block_size: 16}\n", "grid.block_size: expected a non-empty list"),
    ("workload: {name: shared}\ngrid: {block_size: ['16']}\n", "block_size: expected int"),
    (GOOD + "base: {block_size: 16}\n", "also set under base"),
    (GOOD + "repeats: 0\n", "repeats"),
    ("workload: {name: shared}\ngrid: {max_num_batched_tokens: [8, 64]}\n",
     "grid point max_num_batched_tokens=8"),
    ("grid: {block_size: [16]}\n", "missing key 'workload'"),
    ("- 1\n- 2\n", "must be a mapping"),
])
def test_ablation_config_errors_name_key_and_file(tmp_path, text, needle):
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_ablation(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_ablation_overrides_and_missing_file(tmp_path):
    spec = load_ablation(_write(tmp_path, GOOD), ["workload.num_prompts=5", "grid.block_size=[8]",
                                                  "base.max_model_len=256"])
    assert spec.workload["num_prompts"] == 5 and spec.points() == [{"block_size": 8}]
    assert spec.base == {"max_model_len": 256}
    with pytest.raises(ConfigError, match="num_prompts"):
        load_ablation(_write(tmp_path, GOOD), ["workload.num_prompts=x"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_ablation(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "ablations").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_ablations_are_valid(path):
    spec = load_ablation(path)
    assert len(spec.points()) >= 2


def test_cli_sweep_dry_run(capsys):
    rc = cli_main(["bench", "sweep", "--config", str(REPO / "configs/ablations/buckets.yaml"),
                   "--dry-run", "--set", "grid.token_buckets=[[], [64]]"])
    assert rc == 0
    assert "2 point(s)" in capsys.readouterr().out
    assert cli_main(["bench", "sweep", "--config", "nope.yaml", "--dry-run"]) == 2


def test_cli_latency_flags(tmp_path):
    from jaxserve.cli import build_parser
    ns = build_parser().parse_args(["bench", "latency", "--batch-size", "2", "--input-len", "8",
                                    "--output-len", "4", "--num-iters", "3",
                                    "--num-iters-warmup", "0", "--max-num-seqs", "4",
                                    "--output-json", str(tmp_path / "l.json")])
    assert (ns.batch_size, ns.input_len, ns.output_len, ns.num_iters, ns.num_iters_warmup) == \
        (2, 8, 4, 3, 0)
    assert ns.max_num_seqs == 4 and callable(ns.fn)
