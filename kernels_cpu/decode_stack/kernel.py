"""A Llama-family decoder stack in one XLA:CPU call: the C++ kernel in stack.cc behind a
jnp signature (built and registered with the attention kernel, one library: build.py).

    decode_stack(x [T, D], cos, sin [T, H / 2], slot_mapping, query_start_loc, seq_lens,
                 block_tables, layers, caches, eps=, scale=) -> (x' [T, D], caches')

layers: per layer (attn_norm [D], wq, wk, wv, wo, mlp_norm [D], w_gate, w_up, w_down),
the projections packed ([N / 32, K, 32], small_matmul/kernel.py: pack) or, all of them,
quantized panels (q, scale, offset) triples (small_matmul/quant.py); caches: per layer
(k, v) [K, NB, bs, H] float32, updated in place (aliased) with the step's keys and
values. x' is the last layer's output before the final norm. float32 activations, or
with int8_acts each matmul's input quantized to int8 per 32 values for the 4-bit
panels' integer dot products (small_matmul/quant.cc) at up to 8 tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.ragged_paged_attention import build

ARGS_PER_LAYER = 11     # kArgsPerLayer in stack.cc
METADATA_ARGS = 7       # x, cos, sin, slot_mapping, cu_q_lens, seq_lens, block_tables


def decode_stack(x: jax.Array, cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array,
                 query_start_loc: jax.Array, seq_lens: jax.Array, block_tables: jax.Array,
                 layers: list[tuple], caches: list[tuple], *, eps: float, scale: float,
                 num_threads: int = 0, int8_acts: bool = False
                 ) -> tuple[jax.Array, list[tuple]]:
    assert len(layers) == len(caches) > 0
    f32, i32 = jnp.float32, jnp.int32
    flat: list[jax.Array] = []
    aliases: dict[int, int] = {}
    outs = [jax.ShapeDtypeStruct(x.shape, f32)]
    quantized = isinstance(layers[0][1], tuple)
    for weights, (k, v) in zip(layers, caches):
        assert len(weights) == ARGS_PER_LAYER - 2
        for w in weights:
            if quantized and isinstance(w, tuple):
                assert len(w) == 3
                flat.extend(w)
            else:
                assert w.dtype == f32 and isinstance(w, jax.Array), type(w)
                flat.append(w)
        assert k.dtype == f32 and v.dtype == f32, (k.dtype, v.dtype)
        for cache in (k, v):
            aliases[METADATA_ARGS + len(flat)] = len(outs)
            flat.append(cache)
            outs.append(jax.ShapeDtypeStruct(cache.shape, f32))
    build.load()
    call = jax.ffi.ffi_call(build.STACK_TARGET, outs, vmap_method="sequential",
                            input_output_aliases=aliases)
    res = call(x.astype(f32), cos.astype(f32), sin.astype(f32), slot_mapping.astype(i32),
               query_start_loc.astype(i32), seq_lens.astype(i32), block_tables.astype(i32),
               *flat, eps=np.float32(eps), scale=np.float32(scale),
               num_threads=np.int64(num_threads), quantized=np.bool_(quantized),
               int8_acts=np.bool_(int8_acts))
    new_caches = [(res[1 + 2 * i], res[2 + 2 * i]) for i in range(len(caches))]
    return res[0], new_caches
