#!/usr/bin/env python
"""Breakdown of one decode step at small batch, default model, fp32.

For each batch size B, B requests of `--input-len` random tokens are prefilled, then
`--iters` decode steps are run piece by piece through the engine's own objects, timing:

  step         engine.step() of a decode step, unpipelined (what one decode step costs)
  launch       embed + the layer calls (groups of layers, --layers-per-call) + head
               launched without waiting (Python + dispatch)
  and, with each piece waited for (a second, synchronous step):
  schedule + batch build   scheduler, then padded batch + sampling inputs (host)
  per layer    each call of a group of layers waited for, per layer (includes its dispatch)
  head         final norm + logits + sampler
  output       device->host of the sampled tokens, request states, scheduler update
and, outside the engine, a layer's matmuls alone at the bucket's rows and the logits
matmul alone, with the bandwidth at which they stream their weights.

    .venv/bin/python -m jaxserve.tools.profile_step [--batch-sizes 1 8] [--token-buckets 16 32 ...]
        [--layers-per-call G]
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LLM
from jaxserve.worker.step_programs import head_weights
from jaxserve.model.decoder import compute_logits
from jaxserve.model.layers import mlp
from jaxserve.sampling.params import SamplingParams


def median_ms(f: Callable[[], Any], n: int = 7) -> float:
    jax.block_until_ready(f())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def stream_gbps() -> float:
    """Streaming-read bandwidth of an XLA reduction over 512 MB (a lower bound: XLA's
    reduction does not reach the machine's peak)."""
    a = jnp.ones((128 << 20,), jnp.float32)
    f = jax.jit(jnp.sum)
    return a.nbytes / median_ms(lambda: f(a), 5) / 1e6


def prefill(llm: LLM, batch: int, input_len: int) -> None:
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        ids = rng.integers(100, llm.model_config.vocab_size, input_len).tolist()
        llm.add_request({"prompt_token_ids": ids}, params)
    core = llm.engine
    target = core.stats.generation_tokens + batch
    while core.stats.generation_tokens < target:       # every request has its first token
        core.step()


def one_step(core: Any, sync: bool) -> dict[str, Any]:
    """One engine decode step with the runner's pieces wrapped in timers (the step's own
    code runs unchanged). sync: wait for each piece's result (a per-piece breakdown);
    else the step runs as in the engine and only the launch times are taken."""
    r, step = core.runner, core.runner._step
    marks: list[tuple[str, float, float]] = []
    scheduled: list[int] = []

    def wrap(name: str, f: Callable) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            if name == "dispatch":
                scheduled.append(a[0].total_num_scheduled_tokens)
            out = f(*a, **k)
            if sync:
                jax.block_until_ready(out)
            marks.append((name, t, time.perf_counter()))
            return out
        return timed
    pieces = {"_embed": step, "_group_fn": step, "_head": step, "dispatch": r, "collect": r}
    if hasattr(step, "_sampler"):     # the layerwise step's sampler is its own program
        pieces["_sampler"] = step
    saved = {name: vars(obj).get(name) for name, obj in pieces.items()}
    for name, obj in pieces.items():
        if name == "_group_fn":     # times each call of a group of layers
            group_fn = getattr(obj, name)
            setattr(obj, name, lambda g, f=group_fn: wrap(f"_layers{g}", f(g)))
        else:
            setattr(obj, name, wrap(name, getattr(obj, name)))
    try:
        t0 = time.perf_counter()
        core.step()
        t1 = time.perf_counter()
    finally:
        for name, obj in pieces.items():     # instance attributes back, methods unshadowed
            if saved[name] is not None:
                setattr(obj, name, saved[name])
            else:
                delattr(obj, name)
    first = {n: (a, b) for n, a, b in reversed(marks)}
    if "_sampler" in first:           # head = final norm + logits + sampler, as before
        first["_head"] = (first["_head"][0], first["_sampler"][1])
    # per layer: each group call's time over its layer count
    layers = [(b - a) / int(n[7:]) for n, a, b in marks if n.startswith("_layers")]
    return {"wall": t1 - t0, "schedule": first["dispatch"][0] - t0,
            "host_build": first["_embed"][0] - first["dispatch"][0],
            "launch": first["_head"][1] - first["_embed"][0],
            "embed": first["_embed"][1] - first["_embed"][0],
            "per_layer": float(np.mean(layers)), "head": first["_head"][1] - first["_head"][0],
            "output": t1 - first["_head"][1],
            "bucket": float(r.buckets.pick(scheduled[0], 0)[0])}


def micro(llm: LLM, rows: int, gbps: float) -> dict[str, float]:
    """Dense matmuls of a layer (mean over all layers) and the logits matmul at `rows`
    rows: ms and the bandwidth at which they read their weights (at 1-8 rows a step is a
    stream over the weights; the floor is bytes / the machine's best read bandwidth)."""
    w = llm.engine.runner.weights
    layer = w["layers"][0]
    x = jnp.asarray(np.random.default_rng(0).standard_normal(
        (rows, layer["wq"].shape[0]), np.float32))
    cfg = llm.engine.runner.cfg
    linear = cfg.linear       # the engine's: it reads the runner's (maybe packed) weights
    f_dense = jax.jit(lambda x, l: (linear(x, l["wq"]), linear(x, l["wk"]),
                                    linear(x, l["wv"]), linear(x, l["wo"]),
                                    mlp(x, l, linear)))
    # the logits matmul as the engine's step runs it (the packed head on the CPU kernel)
    head = w.get("head_packed", w.get("lm_head", w["embed"]))
    f_logits = jax.jit(lambda x, hw: compute_logits(hw, x, cfg.linear))
    layer_bytes = sum(layer[k].nbytes for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                 "w_down"))
    layers = w["layers"]      # cycled through, as in a step: 30 x 14 MB does not fit in cache
    dense = median_ms(lambda: [f_dense(x, lw) for lw in layers]) / len(layers)
    logits = median_ms(lambda: f_logits(x, head_weights(w)))
    return {"dense_ms": dense, "dense_gbps": layer_bytes / dense / 1e6,
            "dense_floor_ms": layer_bytes / gbps / 1e6, "logits_ms": logits,
            "logits_gbps": head.nbytes / logits / 1e6, "logits_floor_ms": head.nbytes / gbps / 1e6}


def profile(llm: LLM, batch: int, input_len: int, iters: int, gbps: float) -> dict:
    prefill(llm, batch, input_len)
    runs = [(one_step(llm.engine, False), one_step(llm.engine, True))
            for _ in range(iters + 1)][1:]
    med = {k: float(np.median([s[k] for s, _ in runs])) for k in ("wall", "launch")}
    med.update({k: float(np.median([s[k] for _, s in runs])) for k in
                ("schedule", "host_build", "embed", "per_layer", "head", "output", "bucket")})
    rows = llm.engine.buckets.rows_for(int(med["bucket"]))
    llm.engine.abort_requests(list(llm.engine.runner.states))
    llm.engine.step()
    return {"batch": batch, "rows": rows, **med, **micro(llm, rows, gbps)}


def report(rows: list[dict], n_layers: int) -> None:
    ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
    print("| batch (bucket T) | step ms | tok/s | schedule + batch build | launch (async) | "
          f"embed | {n_layers} layers (each) | head: logits + sampler | output | "
          "one layer's matmuls alone ms (weights GB/s) | logits matmul alone ms (GB/s) |")
    print("|---" * 11 + "|")
    for r in rows:
        print(f"| {r['batch']} ({int(r['bucket'])}) | {ms(r['wall'])} | "
              f"{r['batch'] / r['wall']:.1f} | {ms(r['schedule'] + r['host_build'])} | "
              f"{ms(r['launch'])} | {ms(r['embed'])} | "
              f"{1e3 * n_layers * r['per_layer']:.1f} ({ms(r['per_layer'])}) | "
              f"{ms(r['head'])} | {ms(r['output'])} | "
              f"{r['dense_ms']:.2f} ({r['dense_gbps']:.0f} GB/s) | "
              f"{r['logits_ms']:.1f} ({r['logits_gbps']:.0f} GB/s) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--token-buckets", type=int, nargs="*", default=None)
    ap.add_argument("--layers-per-call", type=int, default=0,
                    help="0 = the engine's auto choice")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    kw = {"token_buckets": ns.token_buckets} if ns.token_buckets is not None else {}
    kw["layers_per_call"] = ns.layers_per_call
    llm = LLM(None, dtype="float32", max_model_len=512, pipeline_steps=False,
              step_mode="layerwise", **kw)
    gbps = stream_gbps()
    print(f"streaming read: {gbps:.1f} GB/s; "
          f"token buckets {list(llm.engine.buckets.token_buckets)}")
    rows = [profile(llm, b, ns.input_len, ns.iters, gbps) for b in ns.batch_sizes]
    report(rows, llm.model_config.num_layers)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"stream_gbps": gbps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
