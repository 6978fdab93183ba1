"""The CPU decoder-stack kernel (kernels_cpu/decode_stack, model/cpu/stack.py): one call
for all layers of a small step computes what the per-layer program computes."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import cpu_backend
from jaxserve.attention.backends import KVWritingAttention
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.model.cpu import SMALL_STEP_TOKENS, stack as cpu_stack
from jaxserve.model import decoder
from jaxserve.model.cpu.matmul import KERNEL_LINEAR, pack_weights
from jaxserve.model.layers import rope_inv_freq
from jaxserve.model.linear import XLA_LINEAR
from kernels_cpu.ragged_paged_attention import build


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not build.available():
        pytest.skip("the CPU kernels did not build here")


BS, NB, P = 16, 12, 4


def _quantized(w, kind):
    """The layer projections as QArrays: int8 per channel, or GGUF Q4_1 blocks (gguf-py)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    from jaxserve.model.cpu.matmul import PACKED_KEYS
    from jaxserve.model.loader.gguf_file import quantized_parts
    from jaxserve.model.quant import QArray, quantize_matrix
    layers = []
    for layer in w["layers"]:
        new = dict(layer)
        for key in PACKED_KEYS:
            m = np.asarray(layer[key]).T                        # HF [out, in]
            if kind == "int8":
                new[key] = quantize_matrix(m, "int8", jnp.float32)
            else:
                new[key] = QArray("q4_1", quantized_parts(quantize(m, Q.Q4_1), Q.Q4_1,
                                                          *m.shape), m.shape)
        layers.append(new)
    return {**w, "layers": layers}


def _case(cfg, seed=0, quant=None):
    """Packed weights (quant: quantized panels of this kind), caches holding random
    context, and a step of 8 tokens: a decode token at position 37, a 4-token prefill
    chunk from 0, a decode token at 15 (its row ending at a block boundary), 2 padding
    tokens."""
    from jaxserve.model.params import init_params
    rng = np.random.default_rng(seed)
    w = init_params(cfg, seed=seed, scale=0.25)
    w = pack_weights(_quantized(w, quant) if quant else w)
    shape = (cfg.num_kv_heads, NB, BS, cfg.head_dim)
    kv = [(jnp.asarray(rng.standard_normal(shape, np.float32)),
           jnp.asarray(rng.standard_normal(shape, np.float32))) for _ in range(cfg.num_layers)]
    tables = np.array([[3, 7, 1, 0], [5, 0, 0, 0], [9, 0, 0, 0], [0, 0, 0, 0]], np.int32)
    positions = np.array([37, 0, 1, 2, 3, 15, 0, 0], np.int32)
    rows = np.array([0, 1, 1, 1, 1, 2, 3, 3], np.int32)
    slot = np.array([tables[r, p // BS] * BS + p % BS if r < 3 else NB * BS
                     for r, p in zip(rows, positions)], np.int32)
    md = AttentionMetadata(
        positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slot),
        token_rows=jnp.asarray(rows), context_lens=jnp.asarray([37, 0, 15, 0], jnp.int32),
        seq_lens=jnp.asarray([38, 4, 16, 0], jnp.int32),
        query_start_loc=jnp.asarray([0, 1, 5, 6, 6], jnp.int32),
        block_tables=jnp.asarray(tables), logits_indices=jnp.asarray([0, 4, 5, 0], jnp.int32))
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, 8), jnp.int32)
    return w, kv, tokens, md, slot


def _run(cfg, w, kv, tokens, md, attn_fn):
    inv = jnp.asarray(rope_inv_freq(cfg))
    f = jax.jit(lambda w, kv, t, md: decoder.layers_forward(w, kv, t, md, cfg, inv, attn_fn))
    return f(w, kv, tokens, md), f.lower(w, kv, tokens, md).as_text()


@pytest.mark.parametrize("shape", [
    dict(),                                                           # tiny: H 16, G 2
    dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=1, head_dim=64,
         num_layers=3, rope_scaling=(("rope_type", "llama3"), ("factor", 8.0),
                                     ("original_max_position_embeddings", 64))),
])
@pytest.mark.parametrize("quant", [None, "int8", "q4_1"])
def test_stack_matches_the_layer_program(shape, quant):
    from engine_utils import tiny_config
    cfg = tiny_config(linear=KERNEL_LINEAR, **shape)
    w, kv, tokens, md, slot = _case(cfg, quant=quant)
    # the same computation per layer: a wrapper the stack check does not recognise
    per_layer = KVWritingAttention(cpu_backend.paged_attention.fn)
    (x_ref, kv_ref), text_ref = _run(cfg, w, kv, tokens, md, per_layer)
    (x, kv_new), text = _run(cfg, w, kv, tokens, md, cpu_backend.paged_attention)
    assert text.count(build.STACK_TARGET) == 1 and build.STACK_TARGET not in text_ref
    scale = float(np.abs(np.asarray(x_ref)).max())
    np.testing.assert_allclose(np.asarray(x), np.asarray(x_ref), rtol=1e-5, atol=1e-5 * scale)
    flat = lambda c: np.asarray(c).reshape(cfg.num_kv_heads, NB * BS, -1)   # noqa: E731
    written = slot[slot < NB * BS]
    for (k, v), (kr, vr), (k0, _) in zip(kv_new, kv_ref, kv):
        for a, b in ((k, kr), (v, vr)):
            # summation order differs (per ISA): an error relative to the cache's scale
            # (layers past the first take x with its rounding, as the x check above)
            kv_scale = float(np.abs(flat(b)[:, written]).max())
            np.testing.assert_allclose(flat(a)[:, written], flat(b)[:, written],
                                       rtol=1e-5, atol=1e-5 * kv_scale)
            rest = np.setdiff1d(np.arange(NB * BS), written)
            assert np.array_equal(flat(a)[:, rest], flat(b)[:, rest])   # untouched slots
        assert not np.array_equal(flat(k)[:, written], flat(k0)[:, written])


def test_stack_only_where_it_applies():
    from engine_utils import tiny_config
    from jaxserve.attention import kv_quant as quant
    cfg = tiny_config(linear=KERNEL_LINEAR)
    w, kv, _, _, _ = _case(cfg)
    ok = cpu_backend.paged_attention
    assert cpu_stack.usable(w, kv, 8, cfg, ok)
    assert not cpu_stack.usable(w, kv, SMALL_STEP_TOKENS + 1, cfg, ok)   # a big bucket
    assert not cpu_stack.usable(w, kv, 1, cfg, KVWritingAttention(ok.fn))   # another backend
    for kw in (dict(linear=XLA_LINEAR), dict(attention_bias=True), dict(qk_norm=True),
               dict(sliding_window=8), dict(hidden_act="gelu_tanh"), dict(norm_offset=1.0),
               dict(sandwich_norms=True), dict(kv_head_replicas=2)):
        assert not cpu_stack.usable(w, kv, 1, tiny_config(**{"linear": KERNEL_LINEAR, **kw}), ok), kw
    from jaxserve.model.params import init_params
    unpacked = init_params(cfg)
    assert not cpu_stack.usable(unpacked, kv, 1, cfg, ok)
    qkv = [(quant.init_layer(k.shape, "int8", jnp.float32),) * 2 for k, _ in kv]
    assert not cpu_stack.usable(w, qkv, 1, cfg, ok)
    biased = {**w, "layers": [{**w["layers"][0], "bq": jnp.zeros(64)}, *w["layers"][1:]]}
    assert not cpu_stack.usable(biased, kv, 1, cfg, ok)


def _direct(cfg, w, kv, x, md, **kw):
    from kernels_cpu.decode_stack.kernel import decode_stack
    inv = jnp.asarray(rope_inv_freq(cfg))
    ang = md.positions.astype(jnp.float32)[:, None] * inv[None, :]
    layers = [tuple(getattr(layer[k], "panels", layer[k]) for k in cpu_stack.LAYER_KEYS)
              for layer in w["layers"]]
    return decode_stack(x, jnp.cos(ang), jnp.sin(ang), md.slot_mapping, md.query_start_loc,
                        md.seq_lens, md.block_tables, layers, kv, eps=cfg.rms_norm_eps,
                        scale=cfg.attention_scale, **kw)


def test_thread_count_changes_no_bit():
    """A panel's sum runs in one thread front to back, the norms in one thread: one
    thread and the whole pool give the same bits."""
    from engine_utils import tiny_config
    cfg = tiny_config(linear=KERNEL_LINEAR)
    w, kv, tokens, md, _ = _case(cfg)
    x = w["embed"][tokens]
    one, kv1 = _direct(cfg, w, [(k + 0, v + 0) for k, v in kv], x, md, num_threads=1)
    pool, kvp = _direct(cfg, w, [(k + 0, v + 0) for k, v in kv], x, md)
    assert np.array_equal(np.asarray(one), np.asarray(pool))
    for (a, b), (c, d) in zip(kv1, kvp):
        assert np.array_equal(np.asarray(a), np.asarray(c))
        assert np.array_equal(np.asarray(b), np.asarray(d))


def test_bad_block_id_is_an_error_not_a_crash():
    from engine_utils import tiny_config
    cfg = tiny_config(linear=KERNEL_LINEAR)
    w, kv, tokens, md, _ = _case(cfg)
    bad = md.block_tables.at[0, 1].set(NB + 5)          # row 0 reads its second block
    md = dataclasses.replace(md, block_tables=bad)
    with pytest.raises(Exception, match="block id out of range"):
        out, _ = _direct(cfg, w, kv, w["embed"][tokens], md)
        np.asarray(out)


@pytest.mark.parametrize("shape", [
    dict(),
    dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=1, head_dim=64,
         num_layers=3),
    dict(num_layers=1),
])
@pytest.mark.skipif(build.cpu_level() is None,
                    reason="portable kernel build: no integer dot products")
def test_int8_activations_in_the_stack(shape):
    """--cpu-int8-activations on 4-bit panels: the stack quantizes each matmul's input as
    the layer program's kernel calls do (the same results up to inputs rounded to the
    other side of an int8 step), and not what the float path computes."""
    from engine_utils import tiny_config
    from jaxserve.model.cpu.matmul import KERNEL_LINEAR_INT8_ACTS
    cfg = tiny_config(linear=KERNEL_LINEAR_INT8_ACTS, **shape)
    w, kv, tokens, md, _ = _case(cfg, quant="q4_1")
    per_layer = KVWritingAttention(cpu_backend.paged_attention.fn)
    (x_ref, _), text_ref = _run(cfg, w, kv, tokens, md, per_layer)
    (x, _), text = _run(cfg, w, kv, tokens, md, cpu_backend.paged_attention)
    assert text.count(build.STACK_TARGET) == 1 and build.STACK_TARGET not in text_ref
    float_cfg = dataclasses.replace(cfg, linear=KERNEL_LINEAR)
    (x_float, _), _ = _run(float_cfg, w, kv, tokens, md, cpu_backend.paged_attention)
    x, x_ref, x_float = (np.asarray(a) for a in (x, x_ref, x_float))
    scale = float(np.abs(x_float).max())
    d_int, d_float = np.abs(x - x_ref).max() / scale, np.abs(x - x_float).max() / scale
    print(f"stack vs layer program (int8): {d_int:.2e}, vs the float path: {d_float:.2e}")
    assert 1e-4 < d_float < 0.2
    # one layer: only inputs that the two programs' float rounding puts on either side of
    # an int8 step differ; more layers of this random model amplify those flips
    assert d_int < d_float / (100 if cfg.num_layers == 1 else 2)
