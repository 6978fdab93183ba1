"""Speed and resident weight bytes of quantized weights on this machine (issue 19 item 5).

    python scripts/bench_quant_speed.py [--settings fp32 int8 gguf] [--rounds 3]

One engine per setting (the embedded SmolLM2-135M-Instruct), all alive in one process;
rounds alternate the settings so that a noisy machine hits them alike. Uses the same
timing as `jaxserve bench latency` (run_latency: fixed random prompts, greedy, EOS
ignored): prefill tok/s = 4 x 256 prompt tokens / latency of 1 output token; decode
tok/s at batch B = B x 16 / (latency of 17 output tokens - latency of 1). Medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.bench.latency import run_latency  # noqa: E402
from jaxserve.engine.llm import LLM  # noqa: E402
from jaxserve.model import quant  # noqa: E402
from jaxserve.model.loader import load_model  # noqa: E402

ENGINE = dict(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512)


def build(name: str) -> tuple[LLM, int]:
    q = {"fp32": "none", "int8": "int8", "int8-w8a8": "int8", "int8-all": "int8", "fp8": "fp8",
         "gguf": "gguf"}[name]
    lm = load_model(None, "float32", progress=False, quantization=q)
    w = lm.weights
    if name in ("int8-w8a8", "int8-all"):
        w = quant.quantize_weights(lm.config, load_model(None, progress=False).weights, "int8",
                                   act="int8" if name == "int8-w8a8" else "none")
    return LLM.from_weights(lm.config, w, lm.tokenizer, **ENGINE), quant.weight_bytes(w)


def latency(llm: LLM, b: int, inp: int, out: int) -> float:
    return run_latency(llm, batch_size=b, input_len=inp, output_len=out, num_iters=2,
                       num_iters_warmup=1)["avg_latency"]


def measure(llm: LLM) -> dict[str, float]:
    r = {"prefill": 4 * 256 / latency(llm, 4, 256, 1)}
    for b in (1, 64):
        t1, t17 = latency(llm, b, 32, 1), latency(llm, b, 32, 17)
        r[f"decode_b{b}"] = b * 16 / max(t17 - t1, 1e-9)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["fp32", "int8", "gguf"],
                    choices=["fp32", "int8", "int8-all", "int8-w8a8", "fp8", "gguf"])
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args(argv)
    engines = {n: build(n) for n in ns.settings}
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in ns.settings}
    for i in range(ns.rounds):
        for n, (llm, _) in engines.items():
            runs[n].append(measure(llm))
            print(f"round {i} {n}: {runs[n][-1]}", file=sys.stderr, flush=True)
    base = ns.settings[0]
    med: dict[str, dict[str, float]] = {
        n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    print(f"| setting | weights MiB | prefill tok/s | decode tok/s B=1 | decode tok/s B=64 |"
          f" (ratios vs {base}) |")
    print("|---|---:|---:|---:|---:|---|")
    for n, (_, nbytes) in engines.items():
        m, b = med[n], med[base]
        ratios = " / ".join(f"{m[k] / b[k]:.2f}" for k in ("prefill", "decode_b1", "decode_b64"))
        print(f"| {n} | {nbytes / 2**20:.1f} | {m['prefill']:.0f} | {m['decode_b1']:.1f} | "
              f"{m['decode_b64']:.0f} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
