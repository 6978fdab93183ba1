"""Time the decoder-stack kernel alone on the default model's shapes (SmolLM2-135M: 30
layers, D 576, 9 query / 3 kv heads of 64, MLP 1536; random packed weights), one decode
row with a 100-token context, as GB/s of weights streamed:

    .venv/bin/python -m kernels_cpu.decode_stack.bench [--tokens 1] [--calls 40]
                                                      [--quant q4_1|q8_0|int8]
                                                      [--int8-acts] [--threads N]

--quant: the projections as quantized panels of that format (small_matmul/quant.py),
the default model's own file being Q4_1; GB/s then counts the panels' bytes.

Compare with a plain read of the same bytes on the same machine (docs/benchmarks.md,
"CPU kernels").
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.decode_stack.kernel import decode_stack
from kernels_cpu.small_matmul.kernel import pack_fast
from kernels_cpu.small_matmul.quant import KINDS, pack_quant

L, D, N, K, H, I, NB, BS, CONTEXT = 30, 576, 9, 3, 64, 1536, 64, 16, 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1, help="decode rows (1-8)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="0: all of XLA's pool")
    ap.add_argument("--int8-acts", action="store_true",
                    help="with a 4-bit --quant: int8 activations (integer dot products)")
    ap.add_argument("--quant", choices=[k for k in KINDS if k != "q4_k"], default=None)
    args = ap.parse_args()
    T = args.tokens
    rng = np.random.default_rng(0)
    nbytes = 0

    def w(k: int, n: int):
        nonlocal nbytes
        if args.quant is None:
            nbytes += k * n * 4
            return pack_fast(jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02))
        parts = random_parts(args.quant, n, k, rng)
        packed = tuple(jnp.asarray(a) for a in pack_quant(args.quant, parts, (n, k)))
        nbytes += sum(a.nbytes for a in packed)
        return packed

    layers = [(jnp.ones(D), w(D, N * H), w(D, K * H), w(D, K * H), w(N * H, D), jnp.ones(D),
               w(D, I), w(D, I), w(I, D)) for _ in range(L)]
    caches = [(jnp.zeros((K, NB, BS, H)), jnp.zeros((K, NB, BS, H))) for _ in range(L)]
    x = jnp.asarray(rng.standard_normal((T, D), np.float32))
    cos, sin = jnp.ones((T, H // 2)), jnp.zeros((T, H // 2))
    blocks = (CONTEXT + 1) // BS + 1
    # T rows, one decode token each, every row CONTEXT tokens deep in its own blocks
    slots = jnp.asarray([r * blocks * BS + CONTEXT for r in range(T)], jnp.int32)
    cu = jnp.arange(T + 1, dtype=jnp.int32)
    lens = jnp.full((T,), CONTEXT + 1, jnp.int32)
    tables = jnp.arange(T * blocks, dtype=jnp.int32).reshape(T, blocks)
    assert T * blocks <= NB
    f = jax.jit(lambda x, caches: decode_stack(x, cos, sin, slots, cu, lens, tables, layers,
                                               caches, eps=1e-5, scale=H ** -0.5,
                                               num_threads=args.threads,
                                               int8_acts=args.int8_acts),
                donate_argnums=1)
    for _ in range(3):
        y, caches = f(x, caches)
    y.block_until_ready()
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        y, caches = f(x, caches)
        y.block_until_ready()
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    print(f"{T} token(s), {L} layers, {nbytes / 2**20:.0f} MiB of weights: median "
          f"{med * 1e3:.2f} ms ({nbytes / med / 1e9:.1f} GB/s), fastest {times[0] * 1e3:.2f} ms")


def random_parts(kind: str, n: int, k: int, rng: np.random.Generator) -> dict:
    """A random matrix [n, k] in the engine's QArray form of `kind` (quant.py's doc)."""
    blocks = (n, k // 32)
    d = (rng.random(blocks) * 0.01 + 0.001).astype(np.float16)
    if kind == "int8":
        return {"q": rng.integers(-127, 128, (n, k), dtype=np.int8),
                "scale": (rng.random(n) * 0.01).astype(np.float32)}
    if kind == "q8_0":
        return {"q": rng.integers(-127, 128, blocks + (32,), dtype=np.int8), "d": d}
    p = rng.integers(0, 256, blocks + (16,), dtype=np.uint8)
    return {"p": p, "d": d} if kind == "q4_0" else {"p": p, "d": d, "m": -8 * d}


if __name__ == "__main__":
    main()
