"""KV-cache quantization error: a scale per (token, head) vs one per (block, head).

    python scripts/bench_kv_scale_granularity.py [--block-size 16]

Runs the embedded SmolLM2-135M-Instruct (fp32) over the shipped corpus in windows of
256 tokens, keeps every layer's real K and V, and quantizes them both ways (int8
symmetric and fp8 e4m3) with attention/kv_quant.py's rounding. Prints the relative RMS
error (||x - x_hat|| / ||x||) and the KV bytes per token of each choice. The engine
ships per-(token, head) scales (attention/kv_quant.py explains why); this measures what a
per-block scale would cost in accuracy and save in bytes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.attention.metadata import AttentionMetadata  # noqa: E402
from jaxserve.attention import kv_quant as quant  # noqa: E402
from jaxserve.model import decoder  # noqa: E402
from jaxserve.model.layers import rope_inv_freq  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "quality_corpus.txt"
WINDOW = 256


def window_kv(cfg, weights, ids: list[int], bs: int) -> list[np.ndarray]:
    """K and V of every layer for one window: arrays [K, T, H] (post-RoPE K)."""
    n = len(ids)
    nb = -(-WINDOW // bs)
    pos = jnp.arange(n, dtype=jnp.int32)
    md = AttentionMetadata(pos, pos, jnp.zeros(n, jnp.int32), jnp.zeros(1, jnp.int32),
                           jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32),
                           jnp.arange(nb, dtype=jnp.int32)[None], jnp.array([n - 1], jnp.int32))
    kv = decoder.init_kv_cache(cfg, nb, bs, jnp.float32)
    _, kv = decoder.forward(weights, kv, jnp.asarray(ids, jnp.int32), md, cfg,
                            jnp.asarray(rope_inv_freq(cfg)))
    K, H = cfg.num_kv_heads, cfg.head_dim
    return [np.asarray(c).reshape(K, nb * bs, H)[:, :n] for layer in kv for c in layer]


def per_block(x: np.ndarray, kind: str, bs: int) -> np.ndarray:
    """x [K, T, H] quantized with one scale per (head, block of bs tokens)."""
    K, T, H = x.shape
    pad = -T % bs
    xb = np.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(K, -1, bs * H)
    q, s = quant.quantize(jnp.asarray(xb), kind)            # a "vector" = the whole block
    return np.asarray(quant.dequantize(q, s)).reshape(K, T + pad, H)[:, :T]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=16)
    ns = ap.parse_args(argv)
    from jaxserve.model.loader import load_model
    lm = load_model(None, "float32", progress=False)
    cfg, tok = lm.config, lm.tokenizer
    ids = list(tok(CORPUS.read_text())["input_ids"])
    err = {(k, g): [0.0, 0.0] for k in ("int8", "fp8") for g in ("token", "block")}
    for s in range(0, len(ids) - 1, WINDOW):
        for x in window_kv(cfg, lm.weights, ids[s:s + WINDOW], ns.block_size):
            for kind in ("int8", "fp8"):
                tok_hat = np.asarray(quant.fake_quantize(jnp.asarray(x), kind))
                for gran, xh in (("token", tok_hat), ("block", per_block(x, kind, ns.block_size))):
                    err[kind, gran][0] += float(((x - xh) ** 2).sum())
                    err[kind, gran][1] += float((x ** 2).sum())
    H, L, K = cfg.head_dim, cfg.num_layers, cfg.num_kv_heads
    per_tok = {"token": 2 * L * K * (H + 4), "block": 2 * L * K * (H + 4 / ns.block_size)}
    print(f"{len(ids)} corpus tokens, {L} layers x {K} kv heads x head_dim {H}, "
          f"block size {ns.block_size}\n")
    print("| storage | scale per | KV bytes / token | relative RMS error |")
    print("|---|---|---:|---:|")
    print(f"| fp32 | - | {2 * L * K * H * 4} | 0 |")
    for (kind, gran), (num, den) in err.items():
        print(f"| {kind} | {gran} x head | {per_tok[gran]:.0f} | {np.sqrt(num / den):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
