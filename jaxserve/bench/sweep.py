"""`jaxserve bench sweep`: an ablation grid over EngineArgs settings, from a YAML file.

    description: block size against the step token budget    # optional
    workload: {name: shared, num_prompts: 32, output_len: 32, seed: 0}
    base: {max_model_len: 512}                  # EngineArgs settings of every point
    grid:                                       # cartesian product, in this order
      block_size: [16, 32]
      max_num_batched_tokens: [256, 512]
    repeats: 1                                  # timed runs per point; medians reported
    output_dir: out/ablations/block_size_x_budget

`workload.name` is one of the named workloads in bench/workload.py (its other keys are
that function's arguments); `base` and `grid` keys are EngineArgs fields, type-checked
like a config file. Every grid point is validated before anything runs. Each point is
a fresh engine, LLM(**base, **point), warmed up (every bucket compiled), then run
`repeats` times on the same seeded workload; the prefix cache is reset before each run
so that runs are alike. Written to output_dir: results.json (spec, environment, every
run), results.csv and results.md (one row per point) and PNG plots (plots.py).
"""
from __future__ import annotations

import csv
import dataclasses
import gc
import inspect
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import yaml
from tqdm.auto import tqdm

from jaxserve.bench.latency import request_latency_stats
from jaxserve.bench.plots import value_label, write_plots
from jaxserve.bench.workload import WORKLOADS, Workload, fixed
from jaxserve.config import ConfigError, EngineArgs, coerce_field
from jaxserve.sampling.params import SamplingParams

log = logging.getLogger("jaxserve")

TOP_KEYS = ("description", "workload", "base", "grid", "repeats", "output_dir")
WORKLOAD_FNS: dict[str, Callable[..., Workload]] = {**WORKLOADS, "fixed": fixed}
_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
# (column, markdown header, format) of the summary table.
TABLE_COLUMNS = (
    ("output_tokens_per_s", "output tok/s", "{:.1f}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.1f}"),
    ("p99_tpot_ms", "p99 TPOT ms", "{:.1f}"),
    ("cached_prompt_tokens", "cached prompt tok", "{:.0f}"),
    ("warmup_seconds", "warm-up s", "{:.1f}"),
)

LLMFactory = Callable[[dict[str, Any]], Any]


@dataclass(slots=True)
class AblationSpec:
    path: str
    workload: dict[str, Any]            # {"name": ..., **arguments of that workload}
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    repeats: int = 1
    output_dir: str = "out/ablations"
    description: str = ""
    overrides: list[str] = field(default_factory=list)

    def points(self) -> list[dict[str, Any]]:
        keys = list(self.grid)
        return [dict(zip(keys, combo)) for combo in itertools.product(*self.grid.values())]

    def make_workload(self, vocab_size: int) -> Workload:
        args = {k: v for k, v in self.workload.items() if k != "name"}
        return WORKLOAD_FNS[self.workload["name"]](vocab_size, **args)


# ---- loading and validation ---------------------------------------------------------
def load_ablation(path: str | Path, overrides: Iterable[str] = ()) -> AblationSpec:
    """Read and validate an ablation config; `overrides` are `dotted.key=YAML value`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"ablation config {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"ablation config {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"ablation config {p} must be a mapping with keys {list(TOP_KEYS)}")
    overrides = list(overrides)
    for item in overrides:
        _apply_override(data, item, p)
    return _validate(data, p, overrides)


def _apply_override(data: dict[str, Any], item: str, p: Path) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. workload.num_prompts=16")
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is not a mapping in {p}")
    node[leaf] = yaml.safe_load(raw)


def _validate(data: dict[str, Any], p: Path, overrides: list[str]) -> AblationSpec:
    src = f"ablation config {p}"
    for key in data:
        if key not in TOP_KEYS:
            raise ConfigError(f"unknown key {key!r} in {src} (allowed: {list(TOP_KEYS)})")
    for key in ("workload", "grid"):
        if key not in data:
            raise ConfigError(f"missing key {key!r} in {src}")
    base = _settings({} if data.get("base") is None else data["base"], "base", src)
    grid = _grid(data["grid"], src)
    if set(base) & set(grid):
        raise ConfigError(f"grid key(s) {sorted(set(base) & set(grid))} also set under "
                          f"base in {src}")
    repeats = data.get("repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ConfigError(f"repeats: expected an int >= 1, got {repeats!r} in {src}")
    for key in ("output_dir", "description"):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f"{key}: expected a string, got {data[key]!r} in {src}")
    spec = AblationSpec(str(p), _workload(data["workload"], src), base, grid, repeats,
                        data.get("output_dir", f"out/ablations/{p.stem}"),
                        data.get("description", ""), overrides)
    for point in spec.points():      # fail now, not at point 7 of 9
        try:
            EngineArgs.from_sources(**spec.base, **point)
        except ConfigError as e:
            raise ConfigError(f"{e} (grid point {point_label(point)} in {src})") from None
    return spec


def _mapping(raw: Any, where: str, src: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r} in {src}")
    return {str(k).replace("-", "_"): v for k, v in raw.items()}


def _settings(raw: Any, where: str, src: str) -> dict[str, Any]:
    out = {}
    for key, value in _mapping(raw, where, src).items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown engine setting {key!r} under {where} in {src}")
        out[key] = coerce_field(_FIELDS[key], value, f"{where} in {src}")
    return out


def _grid(raw: Any, src: str) -> dict[str, list[Any]]:
    grid = _mapping(raw, "grid", src)
    if not grid:
        raise ConfigError(f"grid: needs at least one setting in {src}")
    out = {}
    for key, values in grid.items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown engine setting {key!r} under grid in {src}")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid.{key}: expected a non-empty list of values in {src}")
        out[key] = [coerce_field(_FIELDS[key], v, f"grid in {src}") for v in values]
    return out


def _workload(raw: Any, src: str) -> dict[str, Any]:
    wl = _mapping(raw, "workload", src)
    name = wl.get("name")
    if not isinstance(name, str) or name not in WORKLOAD_FNS:
        raise ConfigError(f"workload.name: {name!r} is not one of {sorted(WORKLOAD_FNS)} in {src}")
    params = inspect.signature(WORKLOAD_FNS[name]).parameters
    allowed = [k for k in params if k != "vocab_size"]
    for key, value in wl.items():
        if key == "name":
            continue
        if key not in allowed:
            raise ConfigError(f"unknown key {key!r} under workload ({name}; allowed: "
                              f"{allowed}) in {src}")
        default = params[key].default
        lo = 0 if key == "seed" else 1
        want_int = isinstance(default, int) or default is inspect.Parameter.empty
        if want_int and (not isinstance(value, int) or isinstance(value, bool) or value < lo):
            raise ConfigError(f"workload.{key}: expected an int >= {lo}, got {value!r} "
                              f"in {src}")
    missing = [k for k in allowed if params[k].default is inspect.Parameter.empty and k not in wl]
    if missing:
        raise ConfigError(f"workload ({name}) needs {missing} in {src}")
    return wl


def point_label(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


# ---- running ------------------------------------------------------------------------
def default_llm(settings: dict[str, Any]) -> Any:
    from jaxserve import LLM
    return LLM(**settings)


def measure(llm: Any, wl: Workload) -> dict[str, Any]:
    """One timed run of `wl`: throughput (as bench throughput defines it) and latency."""
    params = SamplingParams(max_tokens=wl.output_len, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.reset_prefix_cache()
    compiles0, steps0 = llm.num_compiles, llm.engine.stats.steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": secs,
        "requests_per_s": len(outs) / secs,
        "output_tokens_per_s": out_tokens / secs,
        "total_tokens_per_s": (out_tokens + wl.num_prompt_tokens) / secs,
        "output_tokens": out_tokens,
        "steps": llm.engine.stats.steps - steps0,
        "recompiles": llm.num_compiles - compiles0,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "preemptions": sum(o.metrics.num_preemptions for o in outs if o.metrics),
        **request_latency_stats(outs),
    }


def run_point(spec: AblationSpec, point: dict[str, Any], make_llm: LLMFactory) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm = make_llm({**spec.base, **point})
    row: dict[str, Any] = {"point": point, "build_seconds": time.perf_counter() - t0,
                           "warmup_seconds": llm.engine.warmup_seconds,
                           "compiled_shapes": llm.num_compiles}
    wl = spec.make_workload(llm.model_config.vocab_size)
    row["workload"] = {"name": wl.name, "requests": len(wl.prompts),
                       "prompt_tokens": wl.num_prompt_tokens, "output_len": wl.output_len}
    row["runs"] = [measure(llm, wl) for _ in range(spec.repeats)]
    row["metrics"] = {k: _median([r[k] for r in row["runs"]]) for k in row["runs"][0]}
    return row


def _median(values: list[Any]) -> int | float:
    m = float(np.median(values))
    return int(m) if all(isinstance(v, int) for v in values) and m.is_integer() else m


def run_sweep(spec: AblationSpec, output_dir: str | Path | None = None,
              make_llm: LLMFactory = default_llm, progress: bool = True) -> dict[str, Any]:
    """Run every grid point (a fresh engine each) and write results and plots."""
    out = Path(output_dir or spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for point in tqdm(spec.points(), desc=f"sweep {Path(spec.path).stem}", unit="point",
                      disable=not progress):
        try:
            rows.append(run_point(spec, point, make_llm))
        except Exception as e:      # one failing point (OOM, a kernel) must not lose the rest
            log.exception("sweep point %s failed", point_label(point))
            rows.append({"point": point, "error": f"{type(e).__name__}: {e}"})
        gc.collect()                # drop the previous engine's device buffers
    result = {"spec": dataclasses.asdict(spec), "environment": _environment(), "points": rows}
    write_results(result, out)
    return result


def _environment() -> dict[str, Any]:
    import jax
    from importlib.metadata import version
    dev = jax.devices()[0]
    return {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "jax": jax.__version__, "jaxserve": version("jaxserve"),
            "platform": dev.platform, "device_kind": dev.device_kind,
            "num_devices": jax.device_count()}


# ---- writing ------------------------------------------------------------------------
def flat_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat dict per point: grid values, medians of every metric, build times, error."""
    rows = []
    for r in result["points"]:
        row = dict(r["point"])
        row.update(r.get("metrics", {}))
        for k in ("warmup_seconds", "build_seconds", "compiled_shapes"):
            if k in r:
                row[k] = r[k]
        row["error"] = r.get("error", "")
        rows.append(row)
    return rows


def markdown_table(result: dict[str, Any]) -> str:
    keys = list(result["spec"]["grid"])
    head = keys + [h for _, h, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in flat_rows(result):
        cells = [value_label(row[k]) for k in keys]
        if row["error"]:
            cells += [f"failed: {row['error']}"] + [""] * (len(TABLE_COLUMNS) - 1)
        else:
            cells += [_fmt(row.get(c), f) for c, _, f in TABLE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: Any, f: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)


def write_results(result: dict[str, Any], out: Path) -> list[Path]:
    spec, rows = result["spec"], flat_rows(result)
    (out / "results.json").write_text(json.dumps(_no_nan(result), indent=2, default=str))
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows({k: value_label(v) if k in spec["grid"] else v for k, v in row.items()}
                    for row in rows)
    wl = ", ".join(f"{k}={v}" for k, v in spec["workload"].items())
    md = [f"# {Path(spec['path']).stem}", "", spec["description"], "",
          f"- config: `{spec['path']}`" + "".join(f" `--set {o}`" for o in spec["overrides"]),
          f"- workload: {wl}; repeats: {spec['repeats']} (medians)",
          f"- base: {spec['base'] or '{}'}",
          f"- environment: {result['environment']}", "", markdown_table(result), ""]
    (out / "results.md").write_text("\n".join(md))
    return [out / "results.json", out / "results.csv", out / "results.md",
            *write_plots(rows, list(spec["grid"]), out)]


def _no_nan(x: Any) -> Any:
    """Strict JSON: NaN (a metric with no samples) becomes null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def main(ns: Any) -> int:
    spec = load_ablation(ns.config, ns.set or ())
    if ns.dry_run:
        print(f"{len(spec.points())} point(s) x {spec.repeats} repeat(s); workload "
              f"{spec.workload}; base {spec.base}")
        for point in spec.points():
            print("  " + point_label(point))
        return 0
    out = Path(ns.output_dir or spec.output_dir)
    result = run_sweep(spec, out)
    print(markdown_table(result))
    print(f"results, table and plots in {out}/")
    return 1 if any("error" in r for r in result["points"]) else 0
