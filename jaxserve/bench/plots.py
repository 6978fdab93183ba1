"""PNG plots of a sweep: the throughput/latency trade-off and each knob's effect.

Uses matplotlib's object API (`Figure(...).savefig`): no pyplot, no GUI backend, no
global state, so it runs headless and inside tests.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxserve.deps import require

THROUGHPUT = ("output_tokens_per_s", "output tok/s")
LATENCIES = (("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"))


def _figure() -> Any:
    """matplotlib's Figure class (matplotlib comes with the `bench` extra)."""
    return require("matplotlib.figure", extra="bench", feature="sweep plots",
                   package="matplotlib").Figure


def value_label(v: Any) -> str:
    """How a grid value reads in tables and on axes ([] / None mean the engine default)."""
    return "default" if v in ([], None) else str(v)


def write_plots(rows: list[dict[str, Any]], grid_keys: list[str], out: Path) -> list[Path]:
    """tradeoff.png plus knob_<key>.png per grid key, from the points that did not fail."""
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        return []
    paths = [plot_tradeoff(ok, grid_keys, out / "tradeoff.png")]
    paths += [plot_knob(ok, key, grid_keys, out / f"knob_{key}.png") for key in grid_keys]
    return paths


def _label(row: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(f"{k}={value_label(row[k])}" for k in keys)


def plot_tradeoff(rows: list[dict[str, Any]], keys: list[str], path: Path) -> Path:
    """Output throughput against mean TTFT and mean TPOT; one marker per configuration."""
    fig = _figure()(figsize=(11, 4.5 + 0.25 * math.ceil(len(rows) / 2)), layout="constrained")
    axes = fig.subplots(1, len(LATENCIES))
    for ax, (metric, title) in zip(axes, LATENCIES):
        for i, r in enumerate(rows):
            ax.scatter(r[metric], r[THROUGHPUT[0]], s=60, color=f"C{i % 10}",
                       marker="os^Dv<>p*h"[(i // 10) % 10], label=_label(r, keys))
        ax.set_xlabel(title)
        ax.set_ylabel(THROUGHPUT[1])
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small")
    fig.suptitle("throughput vs latency (one marker per engine configuration; "
                 "up and left is better)")
    fig.savefig(path, dpi=100)
    return path


def plot_knob(rows: list[dict[str, Any]], key: str, keys: list[str], path: Path) -> Path:
    """Throughput, TTFT and TPOT against one grid key: bars when it is the only key,
    else one line per combination of the other keys."""
    others = [k for k in keys if k != key]
    values = list(dict.fromkeys(value_label(r[key]) for r in rows))     # grid order
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_label(r, others), []).append(r)
    panels = (THROUGHPUT, *LATENCIES)
    fig = _figure()(figsize=(4.2 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels))
    for ax, (metric, title) in zip(axes, panels):
        for gi, (name, group) in enumerate(groups.items()):
            pts = sorted((values.index(value_label(r[key])), r[metric]) for r in group)
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            if others:
                ax.plot(xs, ys, marker="o", color=f"C{gi % 10}", label=name)
            else:
                ax.bar(xs, ys, color="C0")
        ax.set_xticks(range(len(values)), values, rotation=20 if len(values) > 4 else 0)
        ax.set_xlabel(key)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3, axis="y")
    if others:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small")
    fig.suptitle(f"effect of {key}")
    fig.savefig(path, dpi=100)
    return path
