"""Grammar libraries side by side for structured outputs: llguidance, xgrammar, outlines-core.

For the default model's tokenizer (SmolLM2-135M-Instruct, 49152 tokens, loaded by
jaxserve's own GGUF tokenizer), per library:
  * compile time (fresh, no cache) of three JSON schemas, a regex and an EBNF grammar
    (n/a where the library cannot take it);
  * per-step mask time at --batch sequences: every sequence holds its own matcher at its
    own position in a valid output of the medium schema; one step fills all the batch's
    bitmask rows (the library's batched fill where it has one), then each sequence
    accepts its next token (timed apart);
and, for the engine's host path (jaxserve/structured/ on llguidance), the other costs of
a step: the [R, W] mask array, and the jitted sampler on CPU with and without a mask.

    python scripts/bench_structured.py [--batch 64] [--steps 40] [--out results.json]
                                       [--engine --max-tokens 32]

A library that is not importable is reported as such (xgrammar needs torch: run with it
on PYTHONPATH from a throwaway install, e.g. pip install --no-deps --target /tmp/glx
xgrammar apache-tvm-ffi outlines-core, then PYTHONPATH=/tmp/glx).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np

SMALL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"], "additionalProperties": False}
MEDIUM = {"type": "object", "properties": {
    "order_id": {"type": "integer"},
    "customer": {"type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string"}},
        "required": ["name", "email"], "additionalProperties": False},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"},
        "price": {"type": "number"}}, "required": ["sku", "qty", "price"],
        "additionalProperties": False}},
    "paid": {"type": "boolean"}},
    "required": ["order_id", "customer", "items", "paid"], "additionalProperties": False}
LARGE = {"type": "object", "properties": {
    f"field_{i}": ({"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                   {"type": "array", "items": {"type": "number"}},
                   {"enum": ["a", "b", "c"]})[i % 5] for i in range(40)},
    "required": [f"field_{i}" for i in range(40)], "additionalProperties": False}
MEDIUM_VALUE = {"order_id": 1042, "customer": {"name": "Ada Lovelace",
                                                "email": "ada@example.com"},
                "items": [{"sku": "A-1", "qty": 2, "price": 9.5},
                          {"sku": "B-22", "qty": 1, "price": 120.0}], "paid": True}
REGEX = r"[a-z]{3,10}@[a-z]{3,10}\.(com|org|net)"
EBNF = '''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"'''
WORKLOADS = [("json small", "json", SMALL), ("json medium", "json", MEDIUM),
             ("json large (40 fields)", "json", LARGE), ("regex (email)", "regex", REGEX),
             ("EBNF (arithmetic)", "ebnf", EBNF)]


def load_tokenizer() -> Any:
    from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
    from jaxserve.model.loader.default_model import default_gguf_path
    return load_gguf_tokenizer(default_gguf_path())


def median_s(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- one adapter per library: compile(kind, spec), new matcher, fill batch, accept ------
class LLGuidance:
    name = "llguidance"

    def __init__(self, hf: Any, vocab: int, eos: int) -> None:
        import llguidance
        from llguidance.hf import from_tokenizer
        self.llg = llguidance
        t0 = time.perf_counter()
        self.tok = from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.version = llguidance.__version__

    def compile(self, kind: str, spec: Any) -> Any:
        from jaxserve.structured.grammar import JSON_OPTIONS
        M = self.llg.LLMatcher
        g = (M.grammar_from_json_schema(spec, defaults=JSON_OPTIONS) if kind == "json"
             else M.grammar_from_regex(spec) if kind == "regex"
             else self.llg.grammar_from("grammar", spec))
        m = M(self.tok, g, log_level=0)
        mask = np.empty((1, (self.tok.vocab_size + 31) // 32), np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)   # first mask: lexer built
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list, mask: np.ndarray) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              mask.ctypes.data, mask.shape[1] * 4,
                                              mask.shape[0])

    def accept(self, m: Any, tok: int) -> None:
        assert m.consume_token(tok), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf: Any, vocab: int, eos: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                                       stop_token_ids=[eos])
        self.setup_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else "?"

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                         separators=(", ", ": "))
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_grammar(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, mask: np.ndarray) -> None:
        import torch
        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(mask))

    def accept(self, m: Any, tok: int) -> None:
        assert m.accept_token(tok)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf: Any, vocab: int, eos: int) -> None:
        import outlines_core
        self.oc = outlines_core
        t0 = time.perf_counter()
        self.vocab = outlines_core.Vocabulary(eos, token_bytes(hf))
        self.setup_s = time.perf_counter() - t0
        from importlib.metadata import version
        self.version = version("outlines-core")

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "ebnf":
            return None                           # regular languages only
        regex = (self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
                 if kind == "json" else spec)
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list, mask: np.ndarray) -> None:
        W = mask.shape[1]
        for i, g in enumerate(matchers):          # no batched fill in the library
            g.write_mask_into(mask[i].ctypes.data, W, 4)

    def accept(self, m: Any, tok: int) -> None:
        m.advance(tok, return_tokens=False)


def token_bytes(hf: Any) -> dict[bytes, list[int]]:
    """token bytes -> ids (byte-level BPE: GPT-2's byte alphabet undone), specials left out."""
    from jaxserve.model.tokenizer.gguf import _byte_alphabet
    dec = {c: b for b, c in _byte_alphabet().items()}
    special = set(hf.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for tok, i in hf.get_vocab().items():
        if i not in special:
            out.setdefault(bytes(dec[c] for c in tok), []).append(i)
    return out


# ---- measurements -------------------------------------------------------------------------
def compile_times(lib: Any, repeats: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for label, kind, spec in WORKLOADS:
        if lib.compile(kind, spec) is None:
            out[label] = None
            continue
        out[label] = median_s(lambda: lib.compile(kind, spec), repeats)
    return out


def medium_value(rng: np.random.Generator) -> dict:
    """A valid instance of MEDIUM with random contents (names, emails, numbers), so the
    sequences of a batch walk different strings, as sampled outputs do."""
    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(lo, hi)))
    return {"order_id": int(rng.integers(1, 10**6)),
            "customer": {"name": f"{word(3, 9).title()} {word(3, 11).title()}",
                         "email": f"{word(3, 10)}@{word(3, 8)}.com"},
            "items": [{"sku": f"{word(1, 3).upper()}-{int(rng.integers(1, 999))}",
                       "qty": int(rng.integers(1, 20)),
                       "price": round(float(rng.uniform(0.5, 500)), 2)}
                      for _ in range(int(rng.integers(1, 4)))],
            "paid": bool(rng.integers(0, 2))}


def small_value(rng: np.random.Generator) -> dict:
    """A valid instance of SMALL (a name of up to 16 letters: maxLength)."""
    name = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(1, 16)))
    return {"name": name.title(), "age": int(rng.integers(0, 121)),
            "color": str(rng.choice(["red", "green", "blue"]))}


def mask_step_times(lib: Any, hf: Any, batch: int, steps: int, schema: dict = MEDIUM,
                    value: Callable[[np.random.Generator], dict] = medium_value
                    ) -> dict[str, float]:
    """Per-step fill and accept time (median over steps) at `batch` sequences, each
    writing its own random valid output of the schema from its own offset."""
    rng = np.random.default_rng(0)
    compiled = lib.compile("json", schema)
    seqs = []
    for b in range(batch):
        ids = hf.encode(json.dumps(value(rng)), add_special_tokens=False)
        m = lib.matcher(compiled)
        pos = b % (len(ids) - 1)
        for t in ids[:pos]:
            lib.accept(m, t)
        seqs.append([m, pos, ids])
    mask = np.empty((batch, (len(hf) + 31) // 32), np.int32)
    fills, accepts = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill([s[0] for s in seqs], mask)
        t1 = time.perf_counter()
        for s in seqs:
            if s[1] >= len(s[2]) - 1:             # near the end: a new output
                s[0], s[1] = lib.matcher(compiled), 0
                s[2] = hf.encode(json.dumps(value(rng)), add_special_tokens=False)
            lib.accept(s[0], s[2][s[1]])
            s[1] += 1
        fills.append(t1 - t0)
        accepts.append(time.perf_counter() - t1)
    return {"fill_ms": 1e3 * statistics.median(fills),
            "fill_mean_ms": 1e3 * statistics.mean(fills),
            "accept_ms": 1e3 * statistics.median(accepts)}


def engine_step_costs(vocab: int, batch: int, reps: int = 30) -> dict[str, float]:
    """The rest of a step's host path in jaxserve: the [R, W] mask (rows copied in from
    the scheduler's bytes), and the jitted sampler (sampling_glue.sample) on CPU without a
    mask, with an all-ones mask (no row constrained) and with every row constrained;
    greedy and temperature-1 rows. Interleaved runs; min and median (a shared machine)."""
    import jax
    import jax.numpy as jnp
    from jaxserve.sampling import in_step as sg
    from jaxserve.sampling.metadata import build_sampling_metadata
    from jaxserve.sampling.params import SamplingParams
    R, W = batch, (vocab + 31) // 32
    rng = np.random.default_rng(0)
    rows = {str(i): rng.integers(-2**31, 2**31, W, dtype=np.int64).astype(np.int32).tobytes()
            for i in range(R)}

    def build() -> np.ndarray:
        m = np.full((R, W), -1, np.int32)
        for i in range(R):
            m[i] = np.frombuffer(rows[str(i)], np.int32)
        return m
    out: dict[str, float] = {"build_mask_ms": 1e3 * median_s(build, 50)}
    logits = jnp.asarray(rng.standard_normal((R, vocab), np.float32))
    masks = {"none": None, "all ones": np.full((R, W), -1, np.int32), "masked": build()}
    state = sg.init_state(R, vocab)
    for label, temp in (("greedy", 0.0), ("t1", 1.0)):
        md = build_sampling_metadata([SamplingParams(temperature=temp)] * R, [0] * R,
                                     [()] * R, R, vocab)
        calls = {}
        for k, m in masks.items():
            inp = jax.tree_util.tree_map(jnp.asarray, sg.SamplingInputs(
                md, np.arange(R, dtype=np.int32), np.ones(R, bool), np.bool_(False),
                np.int32(1), token_mask=m))
            f = jax.jit(lambda x, i, s: sg.sample(x, i, s, jax.random.PRNGKey(0),
                                                  num_logprobs=0)[0].token_ids)
            f(logits, inp, state).block_until_ready()
            calls[k] = (f, inp)
        times: dict[str, list[float]] = {k: [] for k in masks}
        for _ in range(reps):
            for k, (f, inp) in calls.items():
                t0 = time.perf_counter()
                f(logits, inp, state).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        for k, v in times.items():
            out[f"sampler_{label}_{k.replace(' ', '_')}_min_ms"] = 1e3 * min(v)
            out[f"sampler_{label}_{k.replace(' ', '_')}_median_ms"] = 1e3 * statistics.median(v)
    return out


def engine_run(batch: int, max_tokens: int) -> dict[str, float]:
    """End to end on the engine (host path, device automaton off): `batch` chat requests
    at temperature 1, unconstrained then each with the small schema; per decode step
    wall time and, for the constrained run, the scheduler's mask fill time per step."""
    from jaxserve.frontend.llm import LLM
    from jaxserve.sampling.params import SamplingParams
    llm = LLM(None, max_num_seqs=batch, max_num_batched_tokens=512, max_model_len=512,
              token_buckets=[batch, 512])
    if getattr(llm.engine, "device_structured", None) is not None:
        llm.engine.device_structured = None
    gate = llm.engine.scheduler.grammar
    convs = [[{"role": "user", "content": f"Describe person number {i} as JSON: name, "
                                          f"age, favourite color."}] for i in range(batch)]
    out: dict[str, float] = {}
    for label, so in (("plain", None), ("json", {"json": SMALL})):
        ps = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=so is None,
                             structured_outputs=so) for i in range(batch)]
        steps0, fill0, rows0 = llm.engine.stats.steps, gate.mask_seconds, gate.mask_rows
        t0 = time.perf_counter()
        res = llm.chat(convs, ps, use_tqdm=False)
        secs = time.perf_counter() - t0
        steps = llm.engine.stats.steps - steps0
        toks = sum(len(r.outputs[0].token_ids) for r in res)
        out[f"{label}_seconds"] = secs
        out[f"{label}_steps"] = steps
        out[f"{label}_tokens"] = toks
        out[f"{label}_ms_per_step"] = 1e3 * secs / max(steps, 1)
        if so is not None:
            rows = gate.mask_rows - rows0
            out["mask_fill_ms_per_step"] = 1e3 * (gate.mask_seconds - fill0) / max(steps, 1)
            out["mask_rows_per_step"] = rows / max(steps, 1)
            out["valid"] = sum(_valid_small(r.outputs[0].text) for r in res)
    return out


def _valid_small(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return isinstance(v, dict) and set(v) == set(SMALL["properties"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="compiles per workload (median)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--engine", action="store_true",
                    help="also run the engine end to end (--batch requests, unconstrained "
                         "vs JSON schema; minutes on a CPU)")
    ap.add_argument("--max-tokens", type=int, default=32, help="per request, with --engine")
    a = ap.parse_args()
    hf = load_tokenizer()
    vocab, eos = len(hf), hf.eos_token_id
    print(f"tokenizer: {vocab} tokens, eos {eos}; batch {a.batch}, {a.steps} steps")
    results: dict[str, Any] = {"vocab": vocab, "batch": a.batch, "libraries": {}}
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        try:
            lib = cls(hf, vocab, eos)
        except ImportError as e:
            print(f"{cls.name}: not importable ({e})")
            results["libraries"][cls.name] = {"error": str(e)}
            continue
        r = {"version": lib.version, "tokenizer_setup_s": lib.setup_s,
             "compile_s": compile_times(lib, a.repeats),
             **mask_step_times(lib, hf, a.batch, a.steps)}
        small = mask_step_times(lib, hf, a.batch, a.steps, SMALL, small_value)
        r.update({f"small_{k}": v for k, v in small.items()})
        results["libraries"][cls.name] = r
        print(f"{cls.name} {lib.version}: " + json.dumps(r))
    results["engine"] = engine_step_costs(vocab, a.batch)
    print("engine host path: " + json.dumps(results["engine"]))
    if a.engine:
        results["engine_run"] = engine_run(a.batch, a.max_tokens)
        print("engine run: " + json.dumps(results["engine_run"]))
    print_table(results)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def print_table(results: dict) -> None:
    libs = {k: v for k, v in results["libraries"].items() if "error" not in v}
    print("\n| | " + " | ".join(f"{k} {v['version']}" for k, v in libs.items()) + " |")
    print("|---" * (len(libs) + 1) + "|")
    print("| tokenizer setup (s) | " + " | ".join(
        f"{v['tokenizer_setup_s']:.2f}" for v in libs.values()) + " |")
    for label, _, _ in WORKLOADS:
        cells = [v["compile_s"][label] for v in libs.values()]
        print(f"| compile {label} (ms) | " + " | ".join(
            "n/a" if c is None else f"{1e3 * c:.1f}" for c in cells) + " |")
    b = results["batch"]
    for key, what in (("fill_ms", "medium schema: mask fill (median)"),
                      ("fill_mean_ms", "medium schema: mask fill (mean)"),
                      ("accept_ms", "medium schema: accept"),
                      ("small_fill_ms", "small schema (maxLength): mask fill (median)"),
                      ("small_fill_mean_ms", "small schema (maxLength): mask fill (mean)")):
        print(f"| {what}, {b} seqs, per step (ms) | " + " | ".join(
            f"{v[key]:.2f}" for v in libs.values()) + " |")


if __name__ == "__main__":
    main()
