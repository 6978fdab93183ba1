#!/usr/bin/env python
"""Time one SmolLM2 decoder layer on three step batches: the whole layer, the layer without
attention, the MLP alone, and the attention backend alone (median of 7 runs).

    .venv/bin/python -m jaxserve.tools.profile_layer [--attention-backend cpu|reference]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.backends import get_attention_backend
from jaxserve.attention.tiles import build_query_tiles
from jaxserve.model import decoder
from jaxserve.model.layers import mlp, rms_norm, rope_inv_freq
from jaxserve.model.loader.load import load_model
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.cases import make_case


def bench(f, *a) -> float:
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def metadata_for(backend, case, q_lens, T, R):
    md = AttentionMetadata(**case.metadata_fields())
    if backend.needs_full_block_tables:
        return md
    bs = case.k_cache.shape[2]
    P = int(-(-int(np.max(case.context_lens)) // bs))
    md = dataclasses.replace(md, block_tables=md.block_tables[:, :P])
    if T > R and P > 0:
        tr, tt, ts = build_query_tiles(case.cu_q_lens, len(q_lens), T, R)
        md = dataclasses.replace(md, tile_rows=jnp.asarray(tr), tile_tokens=jnp.asarray(tt),
                                 token_tile_slot=jnp.asarray(ts))
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--attention-backend", default="cpu")
    ns = ap.parse_args()
    backend = get_attention_backend(ns.attention_backend)
    lm = load_model(None, "float32", quantization="none")
    cfg, layer = lm.config, lm.weights["layers"][0]
    inv = jnp.asarray(rope_inv_freq(cfg))
    rng = np.random.default_rng(0)
    K, G, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    batches = [
        ("512 tokens: 30 decodes + 2 chunks after context", [1] * 30 + [200, 282],
         list(rng.integers(16, 320, 30)) + [0, 40], 512),
        ("512 tokens: 4 first chunks of 128", [128] * 4, [0] * 4, 512),
        ("64 decodes, contexts 16..320", [1] * 64, list(rng.integers(16, 320, 64)), 64),
    ]
    print(f"backend: {backend.name}\n| batch | layer ms | no-attention ms | MLP ms | attention ms |"
          "\n|---|---|---|---|---|")
    for name, q_lens, ctx, T in batches:
        R = 64
        c = make_case(rng, q_lens, ctx, num_tokens=T, num_rows=R, num_kv_heads=K, group=G,
                      head_dim=H, block_size=16, pages=32, num_blocks=2400)
        md = metadata_for(backend, c, q_lens, T, R)
        x = jnp.asarray(rng.standard_normal((T, cfg.hidden_size), np.float32))

        def layer_fn(attn, x, k, v, md):
            return decoder.decoder_layer(x, layer, k, v, md, cfg, inv, attn)
        full = jax.jit(functools.partial(layer_fn, backend.attn_fn), donate_argnums=(1, 2))
        no_attn = jax.jit(functools.partial(layer_fn, lambda q, *a, **kw: q),
                          donate_argnums=(1, 2))
        f_mlp = jax.jit(lambda x: mlp(rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps), layer))
        f_att = jax.jit(lambda q, kn, vn, k, v, md: backend.attn_fn(q, kn, vn, k, v, md,
                                                                    scale=H ** -0.5))
        q = jnp.asarray(rng.standard_normal((T, cfg.num_heads, H), np.float32))

        def carried(f):
            """Time f with the KV cache donated and carried, as the engine calls a layer."""
            state = [jnp.copy(c.k_cache), jnp.copy(c.v_cache)]

            def run(x, md):
                out, state[0], state[1] = f(x, state[0], state[1], md)
                return out
            return run
        print(f"| {name} | {bench(carried(full), x, md):.1f} | "
              f"{bench(carried(no_attn), x, md):.1f} | {bench(f_mlp, x):.1f} | "
              f"{bench(f_att, q, c.k_new, c.v_new, c.k_cache, c.v_cache, md):.1f} |")


if __name__ == "__main__":
    main()
