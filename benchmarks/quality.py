"""Quality of quantized weights and KV caches vs the full-precision
model.

    python -m benchmarks.quality [--settings int8 int8-w8a8 kv-int8 ...] [--json out.json]

Settings: int8 / int8-all / int8-w8a8 / fp8 quantize the weights; gguf is the default
model's own Q4_1 / Q8_0 blocks (how it loads by default), gguf-q8_0 the blocks of a Q8_0
GGUF written from the fp32 weights (benchmarks/harness.py); gguf-int8-acts the default
model's blocks with --cpu-int8-activations (its integer products apply at <= 8 rows, so
its windows are scored 8 tokens a step, as decode steps run; needs the CPU kernels);
gguf-q8_0-int8-acts the Q8_0 file's blocks with --cpu-int8-activations (its integer products
apply past 8 rows on CPUs with AVX512-VNNI: generation runs 32 sequences a step and each
window is scored as one prefill on the kernel); kv-int8 / kv-fp8
keep fp32 weights and store the KV cache quantized (--kv-cache-dtype int8 / fp8): the
engine's cache for generation, the scorer's prefill cache for logprobs and perplexity.

For each setting, against fp32 (the embedded SmolLM2-135M-Instruct, dequantized):
  * greedy agreement on chat prompts: mean common-prefix length of 32 greedy tokens
    (as a fraction of 32) and the share of prompts whose first 4 tokens are equal;
  * mean |delta logprob| of the fp32 model's greedy tokens (teacher-forced);
  * perplexity on tests/data/quality_corpus.txt (windows of 256 tokens).
Generation runs through the engine (EngineCore, greedy); scoring runs one jitted
prefill per window with the reference attention.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.model import decoder, quant
from jaxserve.model.layers import rope_inv_freq
from jaxserve.model.params import quantize_weights

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "quality_corpus.txt"
GEN_TOKENS, WINDOW, BLOCK = 32, 256, 16
SETTINGS = ("int8", "int8-all", "int8-w8a8", "fp8", "gguf", "gguf-q8_0", "gguf-int8-acts",
            "gguf-q8_0-int8-acts", "kv-int8", "kv-fp8")
DECODE_ROWS = 8       # gguf-int8-acts scores windows in steps of this many tokens
# settings with --cpu-int8-activations: the rows a step has where their integer products run
INT8_ACT_ROWS = {"gguf-int8-acts": DECODE_ROWS, "gguf-q8_0-int8-acts": WINDOW}
CHAT_PROMPTS = [
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Explain what a prime number is.", "Write a haiku about autumn leaves.",
    "How do I boil an egg?", "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What are the planets in our solar system?",
    "How can I improve my handwriting?", "Summarize the story of Cinderella in two sentences.",
    "What does a computer's CPU do?", "Give me a simple recipe for pancakes.",
    "What is photosynthesis?", "How many days are in a leap year?",
    "Write a short thank-you note to a teacher.", "What are some good habits for studying?",
    "Explain gravity to a five-year-old.", "What is the boiling point of water?",
    "List three animals that live in the ocean.", "How do I start learning to play guitar?",
    "What is a healthy breakfast?", "Describe a rainbow in one sentence.",
    "How does a bicycle stay upright?", "What should I pack for a weekend camping trip?",
    "Explain the water cycle.", "Write a short poem about the sea.",
    "What is the tallest mountain in the world?", "How do vaccines work?",
    "Give me an idea for a birthday party for a ten-year-old.", "What is a noun?",
    "How do I make a cup of tea?", "Why do leaves change colour in autumn?",
    "What is the largest animal on Earth?", "Recommend a book for a long train journey.",
    "How can I save money on groceries?", "What is the meaning of the word 'curious'?",
    "Explain how a rainbow forms.", "What are the three states of matter?",
    "Write a two-line story about a lost cat.", "How do bees make honey?",
    "What is the difference between a lake and a sea?", "How do I tie a simple knot?",
    "What is the speed of light?", "Give me a fun fact about penguins.",
    "How should I prepare for a job interview?", "What is an atom made of?",
]


def kv_cache_dtype(name: str) -> str:
    """The --kv-cache-dtype of a setting: kv-int8 -> int8, kv-fp8 -> fp8, else auto."""
    return name[3:] if name.startswith("kv-") else "auto"


def setting_weights(name: str, cfg: Any, fp32: Any) -> Any:
    if name.startswith("kv-"):
        return fp32
    if name.startswith("gguf"):
        from jaxserve.model.loader.load import load_model
        from .harness import gguf_for_default_model
        src = str(gguf_for_default_model("Q8_0")) if name.startswith("gguf-q8_0") else None
        return load_model(src, "float32", progress=False, quantization="gguf").weights
    # "int8" is what --quantization int8 makes (embedding / head stay float); "int8-all"
    # and the others quantize them too
    kind = "fp8" if name == "fp8" else "int8"
    return quantize_weights(cfg, fp32, kind, act="int8" if name == "int8-w8a8" else "none",
                                  embed=name != "int8")


def greedy(cfg: Any, weights: Any, prompts: list[list[int]],
           kv_dtype: str = "auto", int8_acts: bool = False,
           rows: int = 32) -> list[list[int]]:
    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    from jaxserve.request import Request
    from jaxserve.sampling.params import SamplingParams
    # rows: sequences a decode step (int8 activations on 4-bit weights apply at <= 8)
    args = EngineArgs(max_model_len=512, max_num_seqs=rows, max_num_batched_tokens=1024,
                      token_buckets=[rows, 1024], num_kv_blocks=1024, kv_cache_dtype=kv_dtype,
                      cpu_int8_activations=int8_acts)
    eng = EngineCore(args, cfg, weights, progress=False)
    for i, p in enumerate(prompts):
        eng.add_request(Request(str(i), list(p), SamplingParams(
            max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.req_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def make_scorer(cfg: Any, kv_dtype: str = "auto") -> Any:
    """(weights, tokens [WINDOW]) -> logprob of token t+1 at every position t [WINDOW-1]."""
    inv = jnp.asarray(rope_inv_freq(cfg))
    nb = WINDOW // BLOCK
    L = jnp.int32(WINDOW)
    md = AttentionMetadata(jnp.arange(WINDOW, dtype=jnp.int32), jnp.arange(WINDOW, dtype=jnp.int32),
                           jnp.zeros(WINDOW, jnp.int32), jnp.zeros(1, jnp.int32), L[None],
                           jnp.array([0, WINDOW], jnp.int32),
                           jnp.arange(nb, dtype=jnp.int32)[None], jnp.array([WINDOW - 1], jnp.int32))

    @jax.jit
    def run(weights: Any, tokens: jax.Array, md: AttentionMetadata) -> jax.Array:
        kv = decoder.init_kv_cache(cfg, nb, BLOCK, jnp.float32, kv_dtype)
        hidden, _ = decoder.forward(weights, kv, tokens, md, cfg, inv)
        lp = jax.nn.log_softmax(decoder.compute_logits(weights, hidden[:-1]), axis=-1)
        return jnp.take_along_axis(lp, tokens[1:, None], axis=-1)[:, 0]
    # the metadata is an argument, not a constant: XLA would spend minutes folding it
    return lambda weights, tokens: run(weights, tokens, md)


def make_decode_scorer(cfg: Any, n: int = DECODE_ROWS) -> Any:
    """make_scorer's function for the int8-activation settings: the window in steps of
    n tokens (each a forward over the cache so far) on the CPU kernel with int8
    activations, the weights packed for it."""
    import dataclasses
    from jaxserve.model.cpu.matmul import KERNEL_LINEAR_INT8_ACTS, pack_weights
    kcfg = dataclasses.replace(cfg, linear=KERNEL_LINEAR_INT8_ACTS)
    inv = jnp.asarray(rope_inv_freq(cfg))
    nb = WINDOW // BLOCK

    @jax.jit
    def chunk(weights: Any, kv: Any, tokens: jax.Array, c: jax.Array) -> tuple:
        pos = c + jnp.arange(n, dtype=jnp.int32)
        md = AttentionMetadata(pos, pos, jnp.zeros(n, jnp.int32), c[None], (c + n)[None],
                               jnp.array([0, n], jnp.int32),
                               jnp.arange(nb, dtype=jnp.int32)[None],
                               jnp.array([n - 1], jnp.int32))
        hidden, kv = decoder.forward(weights, kv, tokens, md, kcfg, inv)
        logits = decoder.compute_logits(weights, hidden, kcfg.linear)
        return jax.nn.log_softmax(logits, axis=-1), kv

    packed: dict[int, Any] = {}

    def score(weights: Any, tokens: jax.Array) -> jax.Array:
        w = packed.setdefault(id(weights), pack_weights(weights))
        kv = decoder.init_kv_cache(cfg, nb, BLOCK, jnp.float32, "auto")
        lps = []
        for c in range(0, WINDOW, n):
            lp, kv = chunk(w, kv, tokens[c:c + n], jnp.int32(c))
            lps.append(lp)
        lp = jnp.concatenate(lps)[:-1]
        return jnp.take_along_axis(lp, tokens[1:, None], axis=-1)[:, 0]
    return score


def kv_bytes_per_token(cfg: Any, kv_dtype: str) -> int:
    """KV cache bytes one token takes over all layers (fp32 compute on CPU)."""
    from jaxserve.worker.kv_device import bytes_per_block
    return bytes_per_block(cfg, 1, jnp.float32, kv_cache_dtype=kv_dtype)


def pad(ids: list[int]) -> jax.Array:
    return jnp.asarray((ids + [0] * WINDOW)[:WINDOW], jnp.int32)


def continuation_logprobs(score: Any, weights: Any, prompts: list[list[int]],
                          conts: list[list[int]]) -> np.ndarray:
    out = []
    for p, c in zip(prompts, conts):
        lp = np.asarray(score(weights, pad(p + c)))
        out.append(lp[len(p) - 1: len(p) - 1 + len(c)])
    return np.concatenate(out)


def perplexity(score: Any, weights: Any, corpus_ids: list[int]) -> float:
    nll, n = 0.0, 0
    for s in range(0, len(corpus_ids) - 1, WINDOW):
        w = corpus_ids[s:s + WINDOW]
        if len(w) < 2:
            break
        lp = np.asarray(score(weights, pad(w)))[:len(w) - 1]
        nll, n = nll - float(lp.sum()), n + len(lp)
    return math.exp(nll / n)


def prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args(argv)
    from jaxserve.model.loader.load import load_model
    lm = load_model(None, "float32", progress=False, quantization="none")
    cfg, fp32, tok = lm.config, lm.weights, lm.tokenizer
    prompts = [list(tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                                add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"]) for p in CHAT_PROMPTS]
    corpus = list(tok(CORPUS.read_text())["input_ids"])
    score = make_scorer(cfg)
    ref = greedy(cfg, fp32, prompts)
    ref_lp = continuation_logprobs(score, fp32, prompts, ref)
    ref_ppl = perplexity(score, fp32, corpus)
    rows = [dict(setting="fp32", weight_mib=quant.weight_bytes(fp32) / 2**20,
                 kv_bytes_per_token=kv_bytes_per_token(cfg, "auto"), prefix=1.0,
                 first4=1.0, dlogprob=0.0, ppl=ref_ppl, ppl_ratio=1.0)]
    for name in ns.settings:
        t0 = time.perf_counter()
        w, kv_dtype = setting_weights(name, cfg, fp32), kv_cache_dtype(name)
        acts = name in INT8_ACT_ROWS
        scorer = (make_decode_scorer(cfg, INT8_ACT_ROWS[name]) if acts else score
                  if kv_dtype == "auto" else make_scorer(cfg, kv_dtype))
        gen = greedy(cfg, w, prompts, kv_dtype, int8_acts=acts,
                     rows=min(INT8_ACT_ROWS.get(name, 32), 32))
        lp = continuation_logprobs(scorer, w, prompts, ref)
        ppl = perplexity(scorer, w, corpus)
        rows.append(dict(setting=name, weight_mib=quant.weight_bytes(w) / 2**20,
                         kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype),
                         prefix=float(np.mean([prefix_len(a, b) for a, b in zip(gen, ref)]))
                         / GEN_TOKENS,
                         first4=float(np.mean([a[:4] == b[:4] for a, b in zip(gen, ref)])),
                         dlogprob=float(np.mean(np.abs(lp - ref_lp))), ppl=ppl,
                         ppl_ratio=ppl / ref_ppl))
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"{len(prompts)} chat prompts x {GEN_TOKENS} greedy tokens; perplexity over "
          f"{len(corpus)} corpus tokens (windows of {WINDOW})\n")
    print("| setting | weights MiB | KV bytes / token | common prefix / 32 | first 4 equal "
          "| mean abs dlogprob | perplexity | ppl / fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setting']} | {r['weight_mib']:.1f} | {r['kv_bytes_per_token']} "
              f"| {r['prefix']:.1%} | {r['first4']:.0%} "
              f"| {r['dlogprob']:.4f} | {r['ppl']:.3f} | {r['ppl_ratio']:.4f} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
