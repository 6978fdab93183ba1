"""Speed and resident bytes of quantized weights and KV caches on this machine.

    python -m benchmarks.quant_speed [--settings fp32 int8 gguf kv-int8] [--rounds 3]
                                     [--batches 1 64]

kv-int8 / kv-fp8: fp32 weights, --kv-cache-dtype int8 / fp8. gguf: the default model's
own Q4_1 / Q8_0 blocks (its default); gguf-q8_0: a Q8_0 GGUF of the same float32 weights
(benchmarks/harness.py), its blocks kept; gguf-int8-acts: gguf with
--cpu-int8-activations.

One engine per setting (the embedded SmolLM2-135M-Instruct), all alive in one process;
rounds alternate the settings so that a noisy machine hits them alike. Uses the same
timing as `jaxserve bench latency` (run_latency: fixed random prompts, greedy, EOS
ignored): prefill tok/s = 4 x 256 prompt tokens / latency of 1 output token; decode
tok/s at batch B = B x 16 / (latency of 17 output tokens - latency of 1). Medians,
and the spread (min-max) of the decode rates over the rounds. Weights MiB: what the
running engine holds (after the CPU kernels' packing).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from jaxserve.bench.latency import run_latency
from jaxserve.frontend.llm import LLM
from jaxserve.model import quant
from jaxserve.model.loader.load import load_model
from jaxserve.model.params import quantize_weights

from .harness import gguf_for_default_model

ENGINE = dict(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512)


def build(name: str) -> tuple[LLM, int]:
    q = {"fp32": "none", "int8": "int8", "int8-w8a8": "int8", "int8-all": "int8", "fp8": "fp8",
         "gguf": "gguf", "gguf-q8_0": "gguf", "gguf-int8-acts": "gguf", "kv-int8": "none",
         "kv-fp8": "none"}[name]
    kv = name[3:] if name.startswith("kv-") else "auto"
    src = str(gguf_for_default_model("Q8_0")) if name == "gguf-q8_0" else None
    lm = load_model(src, "float32", progress=False, quantization=q)
    w = lm.weights
    if name in ("int8-w8a8", "int8-all"):
        dense = load_model(None, progress=False, quantization="none").weights
        w = quantize_weights(lm.config, dense, "int8",
                             act="int8" if name == "int8-w8a8" else "none")
    llm = LLM.from_weights(lm.config, w, lm.tokenizer, **ENGINE, kv_cache_dtype=kv,
                           cpu_int8_activations=name == "gguf-int8-acts")
    return llm, quant.weight_bytes(llm.engine.runner.weights)


def kv_bytes_per_token(llm: LLM) -> int:
    """Resident KV bytes per token slot, from the engine's own arrays."""
    import jax
    eng = llm.engine
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(eng.runner.kv))
    return nbytes // (eng.kv_manager.num_blocks * eng.args.block_size)


def latency(llm: LLM, b: int, inp: int, out: int) -> float:
    return run_latency(llm, batch_size=b, input_len=inp, output_len=out, num_iters=2,
                       num_iters_warmup=1)["avg_latency"]


def measure(llm: LLM, batches: list[int]) -> dict[str, float]:
    r = {"prefill": 4 * 256 / latency(llm, 4, 256, 1)}
    for b in batches:
        t1, t17 = latency(llm, b, 32, 1), latency(llm, b, 32, 17)
        r[f"decode_b{b}"] = b * 16 / max(t17 - t1, 1e-9)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["fp32", "int8", "gguf"],
                    choices=["fp32", "int8", "int8-all", "int8-w8a8", "fp8", "gguf",
                             "gguf-q8_0", "gguf-int8-acts", "kv-int8", "kv-fp8"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64],
                    help="decode batch sizes measured")
    ns = ap.parse_args(argv)
    keys = ["prefill", *(f"decode_b{b}" for b in ns.batches)]
    engines = {n: build(n) for n in ns.settings}
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in ns.settings}
    for i in range(ns.rounds):
        for n, (llm, _) in engines.items():
            runs[n].append(measure(llm, ns.batches))
            print(f"round {i} {n}: {runs[n][-1]}", file=sys.stderr, flush=True)
    base = ns.settings[0]
    med: dict[str, dict[str, float]] = {
        n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    cols = " | ".join(f"decode tok/s B={b} (min-max)" for b in ns.batches)
    print(f"| setting | weights MiB | KV bytes / token | prefill tok/s | {cols} |"
          f" (ratios vs {base}: {' / '.join(keys)}) |")
    print("|---|---:|---:|---:|" + "---:|" * len(ns.batches) + "---|")
    for n, (llm, nbytes) in engines.items():
        m, b = med[n], med[base]
        ratios = " / ".join(f"{m[k] / b[k]:.2f}" for k in keys)
        dec = " | ".join(f"{m[k]:.1f} ({min(r[k] for r in runs[n]):.1f}-"
                         f"{max(r[k] for r in runs[n]):.1f})" for k in keys[1:])
        print(f"| {n} | {nbytes / 2**20:.1f} | {kv_bytes_per_token(llm)} | {m['prefill']:.0f} | "
              f"{dec} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
