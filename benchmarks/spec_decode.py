"""Speculative decoding on this machine: each method on vs off, alternated back to back.

    python -m benchmarks.spec_decode [--k 4] [--rounds 2] [--copy-prompts 6]
                                        [--methods ngram self draft_model]
                                        [--self-layers 8] [--draft-layers 8]
                                        [--skip-saturation] [--output-json f.json]

Engines on the embedded SmolLM2-135M-Instruct (fp32, shared weights) in one process:
`off` (no speculative_config) and one per method: `ngram`; `self` (the target's first
--self-layers layers, its norm and head propose); `draft_model`: no smaller checkpoint
with SmolLM2's vocabulary is at hand offline, so the draft is a checkpoint written
here from the default model's first --draft-layers layers, norm and head (orbax, in a
temporary directory): the same proposals as `self` with as many layers, but run as a
separate model with its own KV pool (the draft_model path: its own weights, pool and
mirror pass). Rounds alternate the engines so a noisy, shared machine hits all alike;
ratios against `off` are quoted.

  copy-heavy, batch 1: chat prompts that ask the model to repeat, or lightly edit,
      a paragraph of real text (tests/data/quality_corpus.txt); greedy, up to
      --copy-tokens tokens; one request at a time; output tokens / second.
  saturation: the shared offline workload (jaxserve.bench.workload: 64 random prompts of 16..256
      tokens, 64 output tokens, greedy, EOS ignored) with speculation configured but
      disabled above --disable-by-batch-size requests (auto-disable) vs off.
Acceptance (rate, mean accepted length, per position) is printed for each method.
"""
from __future__ import annotations

import argparse
import json
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from jaxserve import SamplingParams
from jaxserve.bench.throughput import run_throughput
from jaxserve.bench.workload import Workload, shared_offline
from jaxserve.frontend.llm import LLM
from jaxserve.model.loader.load import load_model
from jaxserve.model.loader.orbax_dir import save_orbax

ENGINE = dict(max_model_len=1024, kv_cache_memory=512 << 20)
EDITS = ["Repeat the following text exactly, word for word:\n\n{p}",
         "Copy the following text, but replace every \"the\" with \"a\":\n\n{p}",
         "Rewrite the following text exactly as it is, adding nothing:\n\n{p}"]


def copy_prompts(llm: LLM, num: int, verbatim: bool = False) -> list[list[int]]:
    """num chat prompts over the corpus' paragraphs; the instructions cycle through EDITS,
    or (verbatim) all ask for a word-for-word copy."""
    paras = [p.strip() for p in (ROOT / "tests/data/quality_corpus.txt").read_text()
             .split("\n\n") if len(p.split()) > 40]
    edits = EDITS[:1] if verbatim else EDITS
    msgs = [[{"role": "user", "content": edits[i % len(edits)].format(p=paras[i % len(paras)])}]
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


def draft_checkpoint(lm, layers: int, where: str) -> str:
    """The default model's first `layers` layers (+ norm, head) as an orbax checkpoint."""
    cfg = dataclasses.replace(lm.config, num_layers=layers)
    dst = Path(where) / f"smollm2-first{layers}"
    save_orbax(dst, cfg, {**lm.weights, "layers": lm.weights["layers"][:layers]})
    lm.tokenizer.save_pretrained(str(dst))
    return str(dst)


def spec_configs(ns: argparse.Namespace, lm, tmp: str) -> dict[str, dict]:
    common = {"num_speculative_tokens": ns.k, "disable_by_batch_size": ns.disable_by_batch_size}
    out = {}
    for m in ns.methods:
        if m == "ngram":
            out[m] = {"method": "ngram", "prompt_lookup_max": ns.lookup_max,
                      "prompt_lookup_min": ns.lookup_min, **common}
        elif m == "self":
            out[m] = {"method": "self", "draft_num_layers": ns.self_layers, **common}
        else:
            out[m] = {"method": "draft_model", **common,
                      "model": draft_checkpoint(lm, ns.draft_layers, tmp)}
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--methods", nargs="+", default=["ngram"],
                    choices=["ngram", "self", "draft_model"])
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--self-layers", type=int, default=8, help="self: draft_num_layers")
    ap.add_argument("--draft-layers", type=int, default=8,
                    help="draft_model: layers of the default model in the draft checkpoint")
    ap.add_argument("--disable-by-batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sat-rounds", type=int, default=2)
    ap.add_argument("--copy-prompts", type=int, default=4)
    ap.add_argument("--copy-tokens", type=int, default=96)
    ap.add_argument("--verbatim", action="store_true",
                    help="every copy prompt asks for a word-for-word copy (SmolLM2-135M "
                         "paraphrases on 'rewrite exactly' and often on edits)")
    ap.add_argument("--skip-saturation", action="store_true")
    ap.add_argument("--skip-copy", action="store_true")
    ap.add_argument("--output-json", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    lm = load_model(None, "float32", progress=False, quantization="none")
    with tempfile.TemporaryDirectory() as tmp:
        specs = spec_configs(ns, lm, tmp)
        engines = {"off": LLM.from_weights(lm.config, lm.weights, lm.tokenizer, **ENGINE)}
        for name, spec in specs.items():
            engines[name] = LLM.from_weights(lm.config, lm.weights, lm.tokenizer, **ENGINE,
                                             speculative_config=spec)
    methods = list(specs)
    compiles0 = {n: e.num_compiles for n, e in engines.items()}
    res: dict = {"specs": specs, "copy": {n: [] for n in engines},
                 "sat": {n: [] for n in engines}, "copy_pair_ratios": {m: [] for m in methods}}
    prompts = copy_prompts(engines["off"], ns.copy_prompts, ns.verbatim)
    wl = shared_offline(lm.config.vocab_size)
    same = {m: True for m in methods}
    res["sat_pair_ratios"] = {m: [] for m in methods}
    warm_up(engines, prompts, shared_offline(lm.config.vocab_size, num_prompts=16, seed=1), ns)
    for r in range(ns.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        if not ns.skip_copy:        # each prompt on every engine back to back
            for i, p in enumerate(prompts):
                outs, rate = {}, {}
                for name in (order if i % 2 == 0 else order[::-1]):
                    outs[name], secs = batch1(engines[name], p, ns.copy_tokens)
                    rate[name] = len(outs[name]) / secs
                    res["copy"][name].append(rate[name])
                for m in methods:
                    same[m] &= outs["off"] == outs[m]
                    res["copy_pair_ratios"][m].append(rate[m] / rate["off"])
                print(f"round {r} prompt {i} copy-heavy batch-1 tok/s: " + ", ".join(
                    f"{n} {rate[n]:.1f}" for n in engines) + " | vs off: " + ", ".join(
                    f"{m} {rate[m] / rate['off']:.2f}x" for m in methods), flush=True)
        if not ns.skip_saturation and r < ns.sat_rounds:
            rate = {}
            for name in order:
                t = run_throughput(engines[name], wl)
                rate[name] = t["output_tokens_per_s"]
                res["sat"][name].append(rate[name])
                print(f"round {r} saturation {name:>11}: {t['output_tokens_per_s']:6.1f} "
                      f"out tok/s ({t['seconds']:.1f} s)", flush=True)
            for m in methods:
                res["sat_pair_ratios"][m].append(rate[m] / rate["off"])
    report(res, engines, methods, compiles0, same, ns.output_json)
    return 0


def warm_up(engines: dict, prompts: list[list[int]], wl: Workload,
            ns: argparse.Namespace) -> None:
    """Untimed: the first copy prompt and 16 other random prompts (`wl`) on every engine. A fresh engine's first seconds of traffic run slower (measured:
    ~30 tok/s rising to ~46 over the first ~10 s at batch 1; first-touch of buffers and
    caches), which otherwise lands on whichever engine goes first in round 0."""
    for name, llm in engines.items():
        if not ns.skip_copy:
            batch1(llm, prompts[0], ns.copy_tokens)
        if not ns.skip_saturation:
            run_throughput(llm, wl)
        print(f"warm-up done: {name}", flush=True)


def report(res: dict, engines: dict, methods: list[str], compiles0: dict, same: dict,
           output_json: str | None) -> None:
    res["acceptance"] = {m: acceptance(engines[m]) for m in methods}
    res["recompiles"] = {n: e.num_compiles - compiles0[n] for n, e in engines.items()}
    res["greedy_outputs_identical"] = same
    for part in ("copy", "sat"):
        if not res[part]["off"]:
            continue
        off = statistics.median(res[part]["off"])
        for m in methods:
            on = statistics.median(res[part][m])
            res[f"{part}_ratio_{m}"] = on / off
            print(f"{part}: {m} {on:.1f} vs off {off:.1f} tok/s (medians) -> {on / off:.2f}x")
    for m in methods:
        if res["sat_pair_ratios"][m]:
            print(f"saturation: {m}: median of back-to-back pair ratios "
                  f"{statistics.median(res['sat_pair_ratios'][m]):.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in res['sat_pair_ratios'][m])})")
        if res["copy_pair_ratios"][m]:
            print(f"copy: {m}: median of back-to-back pair ratios "
                  f"{statistics.median(res['copy_pair_ratios'][m]):.2f}x")
        print(f"acceptance {m}:", json.dumps(res["acceptance"][m]))
    print("recompiles after warm-up:", res["recompiles"],
          "| greedy outputs identical:", same)
    if output_json:
        Path(output_json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    sys.exit(main())
