"""Speculative decoding (n-gram) on this machine: on vs off, alternated back to back.

    python scripts/bench_spec_decode.py [--k 4] [--rounds 2] [--copy-prompts 6]
                                        [--skip-saturation] [--output-json f.json]

Two engines on the embedded SmolLM2-135M-Instruct (fp32, shared weights) in one
process: `off` (no speculative_config) and `ngram`. Rounds alternate them so a noisy,
shared machine hits both alike; ratios are quoted.

  copy-heavy, batch 1: chat prompts that ask the model to repeat, or lightly edit,
      a paragraph of real text (tests/data/quality_corpus.txt); greedy, up to
      --copy-tokens tokens; one request at a time; output tokens / second.
  saturation: the shared offline workload (DESIGN.md: 64 random prompts of 16..256
      tokens, 64 output tokens, greedy, EOS ignored) with speculation configured but
      disabled above --disable-by-batch-size requests (auto-disable) vs off.
Acceptance (rate, mean accepted length, per position) is printed for the ngram engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.bench.throughput import run_throughput  # noqa: E402
from jaxserve.bench.workload import shared_offline  # noqa: E402
from jaxserve.engine.llm import LLM  # noqa: E402
from jaxserve.model.loader import load_model  # noqa: E402

ENGINE = dict(max_model_len=1024, kv_cache_memory=512 << 20)
EDITS = ["Repeat the following text exactly, word for word:\n\n{p}",
         "Copy the following text, but replace every \"the\" with \"a\":\n\n{p}",
         "Rewrite the following text exactly as it is, adding nothing:\n\n{p}"]


def copy_prompts(llm: LLM, num: int) -> list[list[int]]:
    paras = [p.strip() for p in (ROOT / "tests/data/quality_corpus.txt").read_text()
             .split("\n\n") if len(p.split()) > 40]
    msgs = [[{"role": "user", "content": EDITS[i % len(EDITS)].format(p=paras[i % len(paras)])}]
            for i in range(num)]
    return [llm.apply_chat_template(m) for m in msgs]


def batch1(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """(output tokens, seconds) of one request run alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    o = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    return o.token_ids, time.perf_counter() - t0


def acceptance(llm: LLM) -> dict:
    return llm.engine.scheduler.spec_stats.as_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--disable-by-batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sat-rounds", type=int, default=2)
    ap.add_argument("--copy-prompts", type=int, default=4)
    ap.add_argument("--copy-tokens", type=int, default=96)
    ap.add_argument("--skip-saturation", action="store_true")
    ap.add_argument("--skip-copy", action="store_true")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": ns.k,
            "prompt_lookup_max": ns.lookup_max, "prompt_lookup_min": ns.lookup_min,
            "disable_by_batch_size": ns.disable_by_batch_size}
    lm = load_model(None, "float32", progress=False)
    engines = {"off": LLM.from_weights(lm.config, lm.weights, lm.tokenizer, **ENGINE),
               "ngram": LLM.from_weights(lm.config, lm.weights, lm.tokenizer, **ENGINE,
                                         speculative_config=spec)}
    compiles0 = {n: e.num_compiles for n, e in engines.items()}
    res: dict = {"spec": spec, "copy": {n: [] for n in engines}, "sat": {n: [] for n in engines}}
    prompts = copy_prompts(engines["off"], ns.copy_prompts)
    wl = shared_offline(lm.config.vocab_size)
    same = True
    for r in range(ns.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        if not ns.skip_copy:        # each prompt on both engines back to back
            for i, p in enumerate(prompts):
                outs, rate = {}, {}
                for name in (order if i % 2 == 0 else order[::-1]):
                    outs[name], secs = batch1(engines[name], p, ns.copy_tokens)
                    rate[name] = len(outs[name]) / secs
                    res["copy"][name].append(rate[name])
                same &= outs["off"] == outs["ngram"]
                res.setdefault("copy_pair_ratios", []).append(rate["ngram"] / rate["off"])
                print(f"round {r} prompt {i} copy-heavy batch-1: ngram {rate['ngram']:6.1f} "
                      f"off {rate['off']:6.1f} tok/s ({len(outs['off'])} tokens) -> "
                      f"{rate['ngram'] / rate['off']:.2f}x", flush=True)
        if not ns.skip_saturation and r < ns.sat_rounds:
            for name in order:
                t = run_throughput(engines[name], wl)
                res["sat"][name].append(t["output_tokens_per_s"])
                print(f"round {r} saturation {name:>5}: {t['output_tokens_per_s']:6.1f} "
                      f"out tok/s ({t['seconds']:.1f} s)", flush=True)
    res["acceptance"] = acceptance(engines["ngram"])
    res["recompiles"] = {n: e.num_compiles - compiles0[n] for n, e in engines.items()}
    res["greedy_outputs_identical"] = same
    for part in ("copy", "sat"):
        if res[part]["off"]:
            on, off = (statistics.median(res[part][n]) for n in ("ngram", "off"))
            res[f"{part}_ratio"] = on / off
            print(f"{part}: ngram {on:.1f} vs off {off:.1f} tok/s (medians) -> {on / off:.2f}x")
    if res.get("copy_pair_ratios"):
        print(f"copy: median of back-to-back pair ratios "
              f"{statistics.median(res['copy_pair_ratios']):.2f}x")
    print("acceptance:", json.dumps(res["acceptance"]))
    print("recompiles after warm-up:", res["recompiles"],
          "| greedy outputs identical:", same)
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
