"""The quantized matmul's three ways with 8-bit panels past 8 rows, side by side in one
process: float activations (the panel dequantized once, the float32 pass), and with
--cpu-int8-activations x in 16 bits (vpdpwssd) or in 8 (vpdpbusd, `narrow_acts`), both
on AVX512-VNNI CPUs only (quant.cc; elsewhere all three run the float path). Q8_0
weights of the default model's MLP shapes, GFLOP/s of the best of --rounds alternated
rounds of 10 calls.

    python -m kernels_cpu.small_matmul.bench_acts [--rows 16 64 512] [--rounds 5]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.small_matmul.quant import pack_quant, quant_matmul_many

MODES = {"float": {}, "x16": {"int8_acts": True},
         "x8": {"int8_acts": True, "narrow_acts": True}}
SHAPES = ((1536, 576), (576, 1536))     # [N, K]: gate/up, down


def q8_0(n: int, k: int, rng: np.random.Generator) -> tuple:
    """Random Q8_0 blocks of an [n, k] weight (int8 values, a float16 scale per 32), packed."""
    parts = {"q": rng.integers(-127, 128, (n, k), dtype=np.int8),
             "d": rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16)}
    return tuple(jnp.asarray(a) for a in pack_quant("q8_0", parts, (n, k)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ns = ap.parse_args()
    rng = np.random.default_rng(0)
    for n, k in SHAPES:
        w = q8_0(n, k, rng)
        for m in ns.rows:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            fns = {name: jax.jit(lambda x, kw=kw: quant_matmul_many(x, [w], **kw)[0])
                   for name, kw in MODES.items()}
            for f in fns.values():
                f(x).block_until_ready()
            best = dict.fromkeys(MODES, float("inf"))
            for _ in range(ns.rounds):
                for name, f in fns.items():
                    t = time.perf_counter()
                    for _ in range(10):
                        y = f(x)
                    y.block_until_ready()
                    best[name] = min(best[name], (time.perf_counter() - t) / 10)
            gflop = 2 * m * n * k / 1e9
            print(f"N={n} K={k} rows={m}: " + "  ".join(
                f"{name} {gflop / s:.0f} GFLOP/s" for name, s in best.items()), flush=True)


if __name__ == "__main__":
    main()
