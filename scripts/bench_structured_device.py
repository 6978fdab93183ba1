"""Per-step cost of structured-output masking at 64 sequences: device path vs host path.

    .venv/bin/python scripts/bench_structured_device.py [--rows 64] [--steps 50]

Every row carries the same constraint (a JSON schema, then a regex) over the embedded
model's tokenizer (49152 ids), and each step samples one token per row from [R, V]
random logits under the mask, so the constraints really advance. Measured per step:

  device    mask rows from the pooled automaton tables + advance, inside one jitted
            program (what the engine step adds), minus the same program unmasked
  host:llg  llguidance (the host path of jaxserve/structured/): fill the [R, W]
            bitmask on the host (its thread pool), send it, apply it in the jitted
            sampler, then consume each row's token on the host
  host:oc   the same with outlines-core Guides on the host (write_mask_into + advance)

Also prints compile time of the device tables and their size. Host numbers include
the device->host token transfer the host path needs every step (the device path
needs none: it composes with asynchronous scheduling).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.model.gguf_tokenizer import load_gguf_tokenizer  # noqa: E402
from jaxserve.model.loader.default_model import default_gguf_path  # noqa: E402
from jaxserve.sampling.bitmask import apply_token_bitmask, mask_logits  # noqa: E402
from jaxserve.sampling.params import StructuredOutputsParams as SO  # noqa: E402
from jaxserve.structured import device_pool, device_step  # noqa: E402
from jaxserve.structured.device_automaton import compile_tables, device_regex  # noqa: E402
from jaxserve.structured.device_vocab import TokenVocabulary  # noqa: E402

V = 49152
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer"},
                         "email": {"type": "string", "format": "email"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "email"]}
REGEX = r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{1,5} [A-Za-z ]{3,30}"


def _time(fn, steps: int) -> float:
    """Median seconds of fn() over steps (after two warm-up calls)."""
    fn(), fn()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_device(tables, R: int, steps: int) -> tuple[float, float]:
    """(masked, plain) median seconds per step."""
    slots = jnp.arange(R, dtype=jnp.int32)
    valid = jnp.ones(R, bool)

    @jax.jit
    def masked(pool, logits, key):
        words = device_step.row_words(pool, slots, None)
        x = mask_logits(logits, words, branch=True)         # as the sampler applies it
        tok = jax.random.categorical(key, x).astype(jnp.int32)
        return device_step.advance(pool, slots, tok, valid), tok

    @jax.jit
    def plain(pool, logits, key):
        return pool, jax.random.categorical(key, logits).astype(jnp.int32)

    out = {}
    logits = jax.random.normal(jax.random.PRNGKey(0), (R, V))
    for name, fn in (("plain", plain), ("masked", masked)):
        auto = device_pool.DeviceAutomata(R + 1, V, max_states=4096)
        for r in range(R):
            auto.attach(f"r{r}", "k", tables)

        def reset(pool):
            for r in range(R):
                pool = auto.start_slot(pool, r, f"r{r}", [])
            return pool
        state = {"pool": reset(auto.init_pool()), "i": 0}

        def one():
            state["i"] += 1
            if state["i"] % 40 == 0:       # restart before the constraint completes
                state["pool"] = reset(state["pool"])
            state["pool"], tok = fn(state["pool"], logits, jax.random.PRNGKey(state["i"]))
            tok.block_until_ready()
        out[name] = _time(one, steps)
    return out["masked"], out["plain"]


def bench_host(make_matchers, fill, consume, R: int, steps: int) -> float:
    apply = jax.jit(lambda logits, words, key: jax.random.categorical(
        key, apply_token_bitmask(logits, words)).astype(jnp.int32))
    logits = jax.random.normal(jax.random.PRNGKey(0), (R, V))
    state = {"m": make_matchers(), "i": 0}

    def one():
        state["i"] += 1
        if state["i"] % 40 == 0:
            state["m"] = make_matchers()
        words = fill(state["m"])
        tok = np.asarray(apply(logits, jnp.asarray(words), jax.random.PRNGKey(state["i"])))
        consume(state["m"], tok)
    return _time(one, steps)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", type=str, default=None, help="write results here")
    a = ap.parse_args()
    tok = load_gguf_tokenizer(default_gguf_path())
    vocab = TokenVocabulary.from_tokenizer(tok, (tok.eos_token_id,), V)
    rows = []
    print(f"platform {jax.default_backend()}, rows {a.rows}, vocab {V}")
    print(f"{'constraint':<10} {'states':>6} {'KiB':>7} {'compile s':>9} "
          f"{'device ms':>9} {'host:llg ms':>11} {'host:oc ms':>10}")
    for name, so in (("json", SO(json=SCHEMA)), ("regex", SO(regex=REGEX))):
        regex = device_regex(so)
        t0 = time.perf_counter()
        tables = compile_tables(regex, vocab)
        compile_s = time.perf_counter() - t0
        masked, plain = bench_device(tables, a.rows, a.steps)
        try:
            llg = bench_host(*host_llguidance(so, tok, a.rows), a.rows, a.steps) - plain
        except ImportError:
            llg = float("nan")
        oc = bench_host(*host_outlines(regex, vocab, a.rows), a.rows, a.steps) - plain
        row = dict(constraint=name, states=tables.num_states,
                   table_kib=tables.nbytes / 1024, compile_s=compile_s,
                   device_ms=(masked - plain) * 1e3, host_llguidance_ms=llg * 1e3,
                   host_outlines_ms=oc * 1e3, unmasked_step_ms=plain * 1e3)
        rows.append(row)
        print(f"{name:<10} {row['states']:>6} {row['table_kib']:>7.0f} "
              f"{compile_s:>9.2f} {row['device_ms']:>9.2f} {row['host_llguidance_ms']:>11.2f} "
              f"{row['host_outlines_ms']:>10.2f}")
    print(f"(per step, over the same program without a mask: {rows[0]['unmasked_step_ms']:.2f}"
          f" ms for sampling {a.rows} x {V} logits)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
