"""Per-step cost of structured-output masking at 64 sequences: device path vs host path.

    .venv/bin/python -m benchmarks.structured_device [--rows 64] [--steps 100] [--engine]

Every row carries the same constraint (a JSON schema, then a regex) over the embedded
model's tokenizer (49152 ids); each step picks one token per row (argmax of random
scores, 8 different score sets in turn) under the mask, so the constraints really
advance. Variants, timed interleaved in rounds, per step:

  plain     argmax over [R, V], tokens to the host: what every step does anyway
  device    the same + the rows' words from the automaton pool, the bitmask applied,
            the states advanced: all in the one jitted program (what the engine step
            adds on the device path)
  host:llg  llguidance (the host path, jaxserve/structured/): fill the [R, W] bitmask
            on the host (its thread pool), send it, apply it on the device, consume
            each row's token on the host
  host:oc   the same with outlines-core Guides on the host (write_mask_into, advance)

cost = median(variant) - median(plain). The host path also forces the engine to wait
for each step's tokens before it can schedule the next (no asynchronous scheduling);
that lost overlap is not in these numbers. Also printed: device table compile time and
size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
from jaxserve.model.loader.default_model import default_gguf_path
from jaxserve.sampling.bitmask import apply_token_bitmask, mask_logits
from jaxserve.sampling.params import StructuredOutputsParams as SO
from jaxserve.structured import device_pool, device_step
from jaxserve.structured.device_automaton import compile_tables, device_regex
from jaxserve.structured.device_vocab import TokenVocabulary

V = 49152
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "pattern": "[A-Z][a-z]{1,20}"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city"]}
# (not "format": "email": outlines-core 0.2.14's Index for it lets 16k multi-byte
# tokens follow the closing brace, in a final state that allows no single byte; the
# device compile's byte-walk check refuses such an index, so it takes the host path)
REGEX = r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{1,5} [A-Za-z ]{3,30}"


NOISE = 8                 # distinct per-step logits (random walks, not one fixed path)


def _logits(R: int) -> jax.Array:
    """[NOISE, R, V] logits: the same random scores for every variant."""
    return 3.0 * jax.random.gumbel(jax.random.PRNGKey(0), (NOISE, R, V))


def device_variant(tables, R: int, advance: bool = True):
    """One step of the device path: words from the pool, mask, argmax, advance (or
    not: the mask's share of the cost)."""
    slots = jnp.arange(R, dtype=jnp.int32)
    valid = jnp.ones(R, bool)
    auto = device_pool.DeviceAutomata(R + 1, V, max_states=4096)
    for r in range(R):
        auto.attach(f"r{r}", "k", tables)

    @jax.jit
    def step(pool, logits):
        words = device_step.row_words(pool, slots, None)
        tok = jnp.argmax(mask_logits(logits, words, branch=True), axis=1).astype(jnp.int32)
        return (device_step.advance(pool, slots, tok, valid) if advance else pool), tok

    def reset(pool):
        for r in range(R):
            pool = auto.start_slot(pool, r, f"r{r}", [])
        return pool
    st = {"pool": reset(auto.init_pool())}

    def one(i: int, logits: jax.Array) -> None:
        if i % 40 == 39:               # restart before most constraints complete
            st["pool"] = reset(st["pool"])
        st["pool"], tok = step(st["pool"], logits)
        np.asarray(tok)                # the engine reads the tokens too (one step later)
    return one


def plain_variant(R: int):
    step = jax.jit(lambda logits: jnp.argmax(logits, axis=1).astype(jnp.int32))
    return lambda i, logits: np.asarray(step(logits))


def host_variant(make_matchers, fill, consume, R: int):
    """One step of the host path: fill the bitmask on the host, send it, mask + argmax
    on the device, tokens back, advance every matcher."""
    step = jax.jit(lambda logits, words: jnp.argmax(
        apply_token_bitmask(logits, words), axis=1).astype(jnp.int32))
    st = {"m": make_matchers()}

    def one(i: int, logits: jax.Array) -> None:
        if i % 40 == 39:
            st["m"] = make_matchers()
        tok = np.asarray(step(logits, jnp.asarray(fill(st["m"]))))
        consume(st["m"], tok)
    return one


def run_rounds(variants: dict, R: int, steps: int, rounds: int = 5,
               clock=time.perf_counter) -> dict[str, float]:
    """Median seconds per step of each variant, interleaved in rounds (a loaded machine
    drifts: every variant sees the same conditions). clock: wall time, or
    time.process_time (CPU seconds of all this process's threads: what the work costs,
    whatever else runs on the machine)."""
    logits = _logits(R)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for name, fn in variants.items():          # warm-up (compiles)
        fn(0, logits[0]), fn(1, logits[1])
    i = 2
    for _ in range(rounds):
        for name, fn in variants.items():
            for _ in range(steps // rounds):
                t0 = clock()
                fn(i, logits[i % NOISE])
                times[name].append(clock() - t0)
                i += 1
    return {k: statistics.median(v) for k, v in times.items()}


def host_outlines(regex: str, vocab: TokenVocabulary, R: int):
    import outlines_core
    index = outlines_core.Index(regex, vocab.outlines())
    W = -(-V // 32)

    def make():
        return [outlines_core.Guide(index) for _ in range(R)]

    def fill(guides):
        words = np.zeros((R, W), np.int32)
        for r, g in enumerate(guides):
            g.write_mask_into(words[r].ctypes.data, W, 4)
        return words

    def consume(guides, tok):
        for g, t in zip(guides, tok):
            if not g.is_finished():
                g.advance(int(t), return_tokens=False)
    return make, fill, consume


def host_llguidance(so, tok, R: int):
    from jaxserve.structured.backend import GrammarBackend
    from jaxserve.structured.matcher import RequestGrammar, fill_bitmasks
    backend = GrammarBackend(tok, vocab_size=V, eos_token_ids=(tok.eos_token_id,))
    job = backend.submit(so)
    job.result()

    def make():
        gs = [RequestGrammar(job) for _ in range(R)]
        for g in gs:
            assert g.ready(backend) and g.error is None, g.error
        return gs

    def consume(gs, toks):
        for g, t in zip(gs, toks):
            if not g.terminated():
                g.accept(int(t))
    return make, lambda gs: fill_bitmasks(backend, gs), consume


def bench_engine(rounds: int, rows: int, max_tokens: int) -> None:
    """The embedded model serving `rows` JSON-schema requests at once (temperature 1.0,
    seeded): device path vs host path (EngineCore.device_structured = None), alternated.
    The host path also makes the engine collect each step before scheduling the next."""
    from jaxserve import LLM, SamplingParams
    llm = LLM(max_num_seqs=rows, max_model_len=512)
    eng = llm.engine
    dev = eng.device_structured
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                             structured_outputs=SO(json=SCHEMA)) for i in range(rows)]
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe person number {i} as JSON."}],
        tokenize=False, add_generation_prompt=True) for i in range(rows)]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)          # compile the tables
    print(f"engine: {rows} JSON-schema requests, max_tokens {max_tokens}")
    for r in range(rounds):
        for name, d in (("device", dev), ("host", None)):
            eng.device_structured = d
            steps0, t0 = eng.stats.steps, time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            secs = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            ok = sum(o.outputs[0].finish_reason == "stop" for o in outs)
            steps = eng.stats.steps - steps0
            print(f"  round {r} {name:<6}: {n / secs:7.1f} output tok/s, {secs / steps * 1e3:7.1f} "
                  f"ms/step, {steps} steps, {ok}/{rows} stopped by the constraint")
    eng.device_structured = dev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", type=str, default=None, help="write results here")
    ap.add_argument("--engine", action="store_true",
                    help="instead: serve --rows JSON-schema requests with the embedded model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()
    if a.engine:
        bench_engine(a.rounds, a.rows, a.max_tokens)
        return
    tok = load_gguf_tokenizer(default_gguf_path())
    vocab = TokenVocabulary.from_tokenizer(tok, (tok.eos_token_id,), V)
    rows = []
    print(f"platform {jax.default_backend()}, rows {a.rows}, vocab {V}; cost per step in "
          f"ms over the unmasked step (wall / CPU time of this process)")
    print(f"{'constraint':<10} {'states':>6} {'KiB':>5} {'compile s':>9} {'device':>13} "
          f"{'(mask only)':>13} {'host:llg':>13} {'host:oc':>13}")
    for name, so in (("json", SO(json=SCHEMA)), ("regex", SO(regex=REGEX))):
        regex = device_regex(so)
        t0 = time.perf_counter()
        tables = compile_tables(regex, vocab)
        compile_s = time.perf_counter() - t0
        row = dict(constraint=name, states=tables.num_states, table_kib=tables.nbytes / 1024,
                   compile_s=compile_s)
        for clock_name, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
            variants = {"plain": plain_variant(a.rows),
                        "device": device_variant(tables, a.rows),
                        "device:mask": device_variant(tables, a.rows, advance=False),
                        "host:oc": host_variant(*host_outlines(regex, vocab, a.rows), a.rows)}
            try:
                variants["host:llg"] = host_variant(*host_llguidance(so, tok, a.rows), a.rows)
            except ImportError:
                pass
            med = run_rounds(variants, a.rows, a.steps, clock=clock)
            row[f"plain_{clock_name}_ms"] = med["plain"] * 1e3
            for k in med:
                if k != "plain":
                    row[f"{k}_{clock_name}_ms"] = (med[k] - med["plain"]) * 1e3
        rows.append(row)
        cell = lambda k: f"{row.get(k + '_wall_ms', float('nan')):6.2f}/{row.get(k + '_cpu_ms', float('nan')):<6.2f}"  # noqa: E731,E501
        print(f"{name:<10} {row['states']:>6} {row['table_kib']:>5.0f} {compile_s:>9.2f} "
              f"{cell('device'):>13} {cell('device:mask'):>13} {cell('host:llg'):>13} "
              f"{cell('host:oc'):>13}")
    print(f"(the unmasked step, argmax over {a.rows} x {V} scores and tokens to the host: "
          f"{rows[0]['plain_wall_ms']:.2f} ms wall, {rows[0]['plain_cpu_ms']:.2f} ms CPU)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
