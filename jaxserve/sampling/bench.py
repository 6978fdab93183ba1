"""Time the jitted batched sampler per step: greedy vs all features on.

    .venv/bin/python -m jaxserve.sampling.bench [--rows 64] [--vocab 49152] [--iters 20]

Prints ms/step per configuration and its ratio to greedy, plus the host metadata
builder's cost. Logits: "peaked" rows follow a Zipf law over a random permutation of the
vocabulary (like a language model's); "flat" rows are N(0, 1), whose top-p mass lies far
beyond the top-k candidates and so exercises the exact threshold search.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling.metadata import build_sampling_metadata
from jaxserve.sampling.params import SamplingParams as SP
from jaxserve.sampling.penalties import init_penalty_state, record_tokens, set_prompt
from jaxserve.sampling.sampler import sample


def make_logits(rows: int, vocab: int, kind: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "flat":
        return rng.standard_normal((rows, vocab)).astype(np.float32)
    zipf = -1.1 * np.log(np.arange(1, vocab + 1, dtype=np.float64)) * 1.5
    return np.stack([zipf[rng.permutation(vocab)] for _ in range(rows)]).astype(np.float32)


def all_features(r: int) -> SP:
    return SP(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, presence_penalty=0.5,
              frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={7: 2.0, 11: -5.0},
              seed=r if r % 2 else None, min_tokens=4, max_tokens=64, logprobs=5)


CONFIGS = {   # name -> (params for row r, logits kind, num_logprobs)
    "greedy": (lambda r: SP(temperature=0), "peaked", None),
    "greedy+logprobs5": (lambda r: SP(temperature=0, logprobs=5), "peaked", 5),
    "temperature only": (lambda r: SP(temperature=1.0), "peaked", None),
    "top_k=50": (lambda r: SP(top_k=50), "peaked", None),
    "top_p=0.95 (peaked)": (lambda r: SP(top_p=0.95), "peaked", None),
    "top_p=0.95 (flat: exact search)": (lambda r: SP(top_p=0.95), "flat", None),
    "all features": (all_features, "peaked", 5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    R, V = args.rows, args.vocab
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} R={R} V={V}")

    state = init_penalty_state(R + 1, V)
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, V, 256), jnp.int32)
    for s in range(R):
        state = set_prompt(state, s, prompt, 200)
    state = record_tokens(state, jnp.arange(R), jnp.arange(R) * 3, jnp.ones(R, bool))
    slots = jnp.arange(R, dtype=jnp.int32)
    step = jax.jit(sample, static_argnames="num_logprobs")
    logits = {k: jnp.asarray(make_logits(R, V, k)) for k in ("peaked", "flat")}

    results = {}
    for name, (make, kind, n_lp) in CONFIGS.items():
        params = [make(r) for r in range(R)]
        md = jax.device_put(build_sampling_metadata(params, [2] * R, [(0,)] * R, R, V))
        key = jax.random.PRNGKey(0)
        jax.block_until_ready(step(logits[kind], md, state, slots, key, num_logprobs=n_lp))
        times = []
        for i in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(step(logits[kind], md, state, slots,
                                       jax.random.fold_in(key, i), num_logprobs=n_lp))
            times.append(time.perf_counter() - t0)
        results[name] = 1e3 * float(np.median(times))

    base = results["greedy"]
    print(f"{'config':34s} {'ms/step':>9s} {'x greedy':>9s}")
    for name, ms in results.items():
        print(f"{name:34s} {ms:9.3f} {ms / base:9.2f}")

    params = [all_features(r) for r in range(R)]
    t0 = time.perf_counter()
    for _ in range(100):
        build_sampling_metadata(params, [2] * R, [(0,)] * R, R, V)
    print(f"host build_sampling_metadata (all features, R={R}): "
          f"{(time.perf_counter() - t0) * 10:.3f} ms")


if __name__ == "__main__":
    main()
