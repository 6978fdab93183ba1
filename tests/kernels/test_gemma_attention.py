"""Gemma's attention on every backend: per-layer sliding windows shorter than the prompt
and attention-logit soft-capping, against the jnp reference.

* one attention call per backend (the C++ CPU kernel, the Pallas GPU kernel and the TPU
  v3 kernel with its fused KV write, both Pallas kernels in interpret mode) at
  head_dim 256, on a ragged batch of a decode, a prefill chunk after context and a
  first chunk, each longer than the window;
* a whole tiny Gemma-2-style model (a sliding and a full layer, soft caps, sandwich
  norms) through decoder.forward, two chunked-prefill steps and a decode step (window 4,
  rows of 14 and 11 tokens), each backend against the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import cpu_backend, pallas_backend, reference
from jaxserve.attention.backends import KVWritingAttention, writes_kv
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.model import decoder
from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import rope_inv_freq
from jaxserve.model.params import init_params
from kernels_pallas.ragged_paged_attention.cases import make_case

BACKENDS = {
    "cpu": cpu_backend.paged_attention,
    "pallas_gpu": functools.partial(pallas_backend.paged_attention, platform="cpu"),
    "pallas_tpu_v3": KVWritingAttention(functools.partial(
        pallas_backend.paged_attention_update, interpret=True)),
}


def _call(fn, case, **kw):
    args = (case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, AttentionMetadata(**case.metadata_fields()))
    out = jax.jit(functools.partial(fn, **kw))(*args)
    return out[0] if writes_kv(fn) else out


WINDOW_CAP = [(5, 4.0), (5, None), (None, 4.0), (11, 30.0)]


def _window_cap_cases():
    """Every backend with each of WINDOW_CAP, but for the TPU kernel (whose interpreter
    compiles a large program per window and cap) not the second window with a cap: the
    same path as (5, 4.0), only other values."""
    for backend in sorted(BACKENDS):
        for window, cap in WINDOW_CAP:
            if backend == "pallas_tpu_v3" and (window, cap) == (11, 30.0):
                continue
            yield pytest.param(backend, window, cap, id=f"{backend}-{window}-{cap}")


@pytest.mark.parametrize("backend,window,cap", list(_window_cap_cases()))
def test_window_and_soft_cap_match_reference(backend, window, cap):
    # rows: a decode at position 17, a 7-token chunk after 9 cached, a 12-token first chunk
    case = make_case(np.random.default_rng(3), [1, 7, 12], [17, 9, 0], num_tokens=24,
                     num_rows=4, num_kv_heads=2, group=3, head_dim=256, block_size=8,
                     pages=3, num_blocks=12)
    kw = dict(scale=256 ** -0.5, sliding_window=window, soft_cap=cap)
    want = _call(reference.paged_attention, case, **kw)
    got = _call(BACKENDS[backend], case, **kw)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(want[:n]), atol=2e-5, rtol=2e-5)
    # the window and the cap change the result: the test would see them ignored
    plain = _call(reference.paged_attention, case, scale=256 ** -0.5)
    assert np.abs(np.asarray(want[:n]) - np.asarray(plain[:n])).max() > 1e-2


# ------------------------------------------------------------------ a whole tiny Gemma

GEMMA = ModelConfig(
    architecture="Gemma2ForCausalLM", family="gemma2", vocab_size=96, hidden_size=64,
    intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
    layer_types=("sliding_attention", "full_attention"), sliding_window=4,
    attn_logit_softcap=5.0, final_logit_softcap=8.0, query_pre_attn_scalar=40.0,
    hidden_act="gelu_tanh", norm_offset=1.0, sandwich_norms=True, embed_scale=True,
    tie_word_embeddings=True)
BS, NUM_BLOCKS, T_PAD = 8, 8, 16


def _step_md(q_lens: list[int], ctx_lens: list[int], tables: np.ndarray) -> AttentionMetadata:
    """One step's metadata, padded to T_PAD tokens (one compile for every step), with
    block tables wide enough for seq_lens (every backend)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows = np.repeat(np.arange(len(q_lens)), q_lens).astype(np.int32)
    pos = np.concatenate([np.arange(c, c + q) for q, c in zip(q_lens, ctx_lens)]).astype(np.int32)
    slots = tables[rows, pos // BS] * BS + pos % BS
    pad = T_PAD - len(pos)                    # padding: row R, position 0, slot dropped
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))   # noqa: E731
    return AttentionMetadata(
        positions=i32(np.pad(pos, (0, pad))),
        slot_mapping=i32(np.pad(slots, (0, pad), constant_values=NUM_BLOCKS * BS)),
        token_rows=i32(np.pad(rows, (0, pad), constant_values=len(q_lens))),
        context_lens=i32(ctx_lens),
        seq_lens=i32(np.add(q_lens, ctx_lens)), query_start_loc=i32(cu),
        block_tables=i32(tables), logits_indices=i32(cu[1:] - 1))


def _run(attn_fn, weights, tokens_per_step, steps):
    inv = jnp.asarray(rope_inv_freq(GEMMA))
    kv = decoder.init_kv_cache(GEMMA, NUM_BLOCKS, BS, jnp.float32)

    @jax.jit
    def step(kv, toks, md):
        h, kv = decoder.forward(weights, kv, toks, md, GEMMA, inv, attn_fn)
        return decoder.compute_logits(weights, h, soft_cap=GEMMA.final_logit_softcap), kv

    outs = []
    for toks, md in zip(tokens_per_step, steps):
        logits, kv = step(kv, toks, md)
        outs.append(np.asarray(logits))
    return outs


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_gemma_model_on_backend_matches_reference(backend):
    weights = init_params(GEMMA, seed=1, scale=0.25)
    rng = np.random.default_rng(0)
    tables = np.array([[3, 5], [1, 6]], np.int32)
    # row 0: 9 then 4 prompt tokens, then a decode; row 1: 7 then 3, then a decode
    plan = [([9, 7], [0, 0]), ([4, 3], [9, 7]), ([1, 1], [13, 10])]
    steps = [_step_md(q, c, tables) for q, c in plan]
    toks = [jnp.asarray(np.pad(rng.integers(0, 96, sum(q)), (0, T_PAD - sum(q))), jnp.int32)
            for q, _ in plan]
    want = _run(reference.paged_attention, weights, toks, steps)
    got = _run(BACKENDS[backend], weights, toks, steps)
    for w, g, (q, _) in zip(want, got, plan):
        np.testing.assert_allclose(g[:sum(q)], w[:sum(q)], atol=1e-4, rtol=1e-4)
