#!/usr/bin/env python
"""Breakdown of one decode step at small batch (issue 21, item 1), default model, fp32.

For each batch size B, B requests of `--input-len` random tokens are prefilled, then
`--iters` decode steps are run piece by piece through the engine's own objects, timing:

  host build   scheduler diff -> padded batch + sampling inputs (numpy, host->device)
  dispatch     launching embed + 30 layers + head without waiting (Python + jit dispatch)
  step wall    the same step launched and waited for (what a decode step costs)
  per layer    one layer called and waited for, x num_layers (includes its dispatch)
  head         final norm + logits + sampler, waited for
  output       device->host of the sampled tokens, request states, scheduler update
and, outside the engine, the layer's matmuls alone at the bucket's rows, the attention
kernel alone, and the logits matmul alone, against the memory-bandwidth floor (bytes of
weights read / streaming bandwidth measured here).

    .venv/bin/python scripts/profile_step.py [--batch-sizes 1 8] [--token-buckets 16 32 ...]
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
from jaxserve.engine import sampling_glue
from jaxserve.engine.runner import InflightStep
from jaxserve.engine.step_inputs import build_step_batch
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
    """Streaming-read bandwidth: an XLA reduction over 512 MB (all host threads)."""
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


def one_step(core: Any) -> dict[str, float]:
    """One decode step through the runner's pieces; returns seconds per piece."""
    r, step = core.runner, core.runner._step
    so = core.scheduler.schedule()
    t0 = time.perf_counter()
    r._update_states(so)
    b = build_step_batch(so, r.states, r.block_table, r.buckets, block_size=r.block_size,
                         num_blocks=r.num_blocks, pad_slot=r.pad_slot,
                         full_tables=r.backend.needs_full_block_tables)
    sampling = sampling_glue.build_inputs(b, r.states, r.cfg.vocab_size)
    key = jax.random.fold_in(r.base_key, r.step_count)
    r.step_count += 1
    jax.block_until_ready((b.tokens, b.md))
    t1 = time.perf_counter()
    # Layers rewrite the same KV slots with the same values: running them twice is harmless.
    x = step._embed(r.weights["embed"], b.tokens)
    kv = []
    for layer, (k, v) in zip(r.weights["layers"], r.kv):
        x, k, v = step._layer(layer, k, v, x, b.md)
        kv.append((k, v))
    t2 = time.perf_counter()
    jax.block_until_ready((x, kv))
    t3 = time.perf_counter()
    per_layer = []
    x = jax.block_until_ready(step._embed(r.weights["embed"], b.tokens))
    t4 = time.perf_counter()
    for i, (layer, (k, v)) in enumerate(zip(r.weights["layers"], kv)):
        t = time.perf_counter()
        x, k, v = jax.block_until_ready(step._layer(layer, k, v, x, b.md))
        per_layer.append(time.perf_counter() - t)
        kv[i] = (k, v)
    r.kv = kv
    t5 = time.perf_counter()
    head_w = {k: r.weights[k] for k in ("final_norm", "embed", "lm_head") if k in r.weights}
    out, r.sampler_state = step._head(head_w, x, b.md.logits_indices, sampling,
                                      r.sampler_state, key)
    jax.block_until_ready(out)
    t6 = time.perf_counter()
    res = r.collect(InflightStep(so, b, out, t6, t6))
    core._finish_step(so, res)
    t7 = time.perf_counter()
    return {"host_build": t1 - t0, "dispatch": t2 - t1, "layers_wall": t3 - t1,
            "embed": t4 - t3, "per_layer": float(np.mean(per_layer)), "head": t6 - t5,
            "output": t7 - t6, "bucket": float(b.tokens.shape[0])}


def micro(llm: LLM, rows: int, gbps: float) -> dict[str, float]:
    """Dense matmuls of a layer (mean over all layers) and the logits matmul at `rows`
    rows, against the floor: their weights' bytes / streaming bandwidth."""
    w = llm.engine.runner.weights
    layer = w["layers"][0]
    x = jnp.asarray(np.random.default_rng(0).standard_normal(
        (rows, layer["wq"].shape[0]), np.float32))
    f_dense = jax.jit(lambda x, l: (x @ l["wq"], x @ l["wk"], x @ l["wv"], x @ l["wo"],
                                    mlp(x, l)))
    head = w.get("lm_head", w["embed"])
    f_logits = jax.jit(lambda x, e: x @ (e if e.shape[0] == x.shape[1] else e.T))
    layer_bytes = sum(layer[k].nbytes for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                 "w_down"))
    layers = w["layers"]      # cycled through, as in a step: 30 x 14 MB does not fit in cache
    return {"dense_ms": median_ms(lambda: [f_dense(x, lw) for lw in layers]) / len(layers),
            "dense_floor_ms": layer_bytes / gbps / 1e6,
            "logits_ms": median_ms(lambda: f_logits(x, head)),
            "logits_floor_ms": head.nbytes / gbps / 1e6}


def profile(llm: LLM, batch: int, input_len: int, iters: int, gbps: float) -> dict:
    prefill(llm, batch, input_len)
    steps = [one_step(llm.engine) for _ in range(iters + 1)][1:]
    med = {k: float(np.median([s[k] for s in steps])) for k in steps[0]}
    rows = llm.engine.buckets.rows_for(int(med["bucket"]))
    llm.engine.abort_requests(list(llm.engine.runner.states))
    llm.engine.step()
    return {"batch": batch, "rows": rows, **med, **micro(llm, rows, gbps)}


def report(rows: list[dict], n_layers: int) -> None:
    ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
    print("| batch (bucket T) | step wall ms | host build | dispatch | embed | "
          f"{n_layers} x layer (each) | head (logits+sampler) | output | "
          "layer matmuls alone / floor | logits matmul alone / floor | tok/s |")
    print("|---|" * 1 + "---|" * 10)
    for r in rows:
        wall = r["host_build"] + r["layers_wall"] + r["head"] + r["output"]
        print(f"| {r['batch']} ({int(r['bucket'])}) | {1e3 * wall:.1f} | {ms(r['host_build'])} | "
              f"{ms(r['dispatch'])} | {ms(r['embed'])} | {1e3 * n_layers * r['per_layer']:.1f} "
              f"({ms(r['per_layer'])}) | {ms(r['head'])} | {ms(r['output'])} | "
              f"{r['dense_ms']:.2f} / {r['dense_floor_ms']:.2f} | "
              f"{r['logits_ms']:.1f} / {r['logits_floor_ms']:.1f} | {r['batch'] / wall:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--token-buckets", type=int, nargs="*", default=None)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    kw = {"token_buckets": ns.token_buckets} if ns.token_buckets is not None else {}
    llm = LLM(None, dtype="float32", max_model_len=512, pipeline_steps=False,
              step_mode="layerwise", **kw)
    gbps = stream_gbps()
    print(f"streaming read: {gbps:.1f} GB/s; token buckets {list(llm.engine.buckets.token_buckets)}")
    rows = [profile(llm, b, ns.input_len, ns.iters, gbps) for b in ns.batch_sizes]
    report(rows, llm.model_config.num_layers)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"stream_gbps": gbps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
