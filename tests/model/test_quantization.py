"""Quantized weights (model/quant.py): dequantized-in-step == gguf-py's dequantize, int8 /
fp8 error bounds, GGUF files kept quantized (resident bytes vs the file's tensor bytes),
engines on quantized weights and lowering for TPU / CUDA (TP=2 == TP=1 on 8 CPU
devices: tests/multidevice/test_quantization_devices.py).

Truths used: gguf-py's quantize / dequantize (llama.cpp's reference formats), numpy
float64 matmuls, the file's own tensor byte counts, and the one-device engine.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from engine_utils import random_prompts, tiny_config, tiny_weights
from jaxserve.model import quant
from jaxserve.model.linear import XLA_LINEAR as linear
from jaxserve.model.loader.gguf_file import quantized_parts
from jaxserve.model.params import is_spec, param_specs, quantize_weights
from engine_utils import core_greedy


KINDS = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q4_K: "q4_k"}


def q4k_bytes(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid Q4_K blocks (gguf-py cannot quantize to Q4_K): f16 d / dmin,
    random 6-bit scale bytes and 4-bit values."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    d = rng.uniform(1e-3, 2e-2, (n, 2)).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (n, 140), dtype=np.uint8)
    return np.concatenate([d, rest], axis=1).reshape(rows, -1)


def gguf_bytes(m: np.ndarray, qtype: Q) -> np.ndarray:
    return q4k_bytes(*m.shape) if qtype == Q.Q4_K else quantize(m, qtype)


def as_qarray(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> quant.QArray:
    parts = quantized_parts(raw, qtype, rows, cols)
    return quant.QArray(KINDS[qtype], {k: jnp.asarray(v) for k, v in parts.items()},
                        (rows, cols))


# ---- dequantized in the step == gguf's dequantize ---------------------------------------

@pytest.mark.parametrize("qtype", list(KINDS))
def test_in_step_dequant_matches_gguf(qtype):
    rows, cols = 48, 512
    m = np.random.default_rng(1).normal(0, 0.05, (rows, cols)).astype(np.float32)
    raw = gguf_bytes(m, qtype)
    truth = dequantize(raw, qtype).reshape(rows, cols)
    w = as_qarray(raw, qtype, rows, cols)
    assert w.nbytes <= 1.12 * raw.nbytes                 # kept quantized, not expanded
    np.testing.assert_allclose(np.asarray(jax.jit(lambda w: w.dequantize())(w)), truth,
                               rtol=1e-6, atol=1e-7)
    x = np.random.default_rng(2).normal(size=(5, cols)).astype(np.float32)
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), w))
    np.testing.assert_allclose(got, x.astype(np.float64) @ truth.T.astype(np.float64),
                               rtol=1e-4, atol=1e-4)
    ids = jnp.asarray([3, 0, 47, 3], jnp.int32)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda w, i: w[i])(w, ids)),
                               truth[np.asarray(ids)], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind, act", [("int8", "none"), ("int8", "int8"), ("fp8", "none")])
def test_per_channel_error_bounds(kind, act):
    rng = np.random.default_rng(3)
    m = rng.normal(0, 0.05, (64, 96)).astype(np.float32)
    m[5] *= 40                                          # one loud channel keeps its own scale
    w = quant.quantize_matrix(m, kind, jnp.float32, act)
    deq = np.asarray(w.dequantize(), np.float64)
    scale = np.abs(m).max(1, keepdims=True)
    rel = 0.5 / 127 if kind == "int8" else 2.0 ** -4     # e4m3: 3 mantissa bits
    assert np.all(np.abs(deq - m) <= rel * scale + 1e-9)
    x = rng.normal(size=(7, 96)).astype(np.float32)
    got = np.asarray(jax.jit(quant.matmul)(jnp.asarray(x), w.map_parts(lambda _, p: jnp.asarray(p))))
    if act == "none":
        np.testing.assert_allclose(got, x @ deq.T, rtol=1e-4, atol=1e-4)
    else:   # activations quantized too: within a percent of the float product's scale
        ref = x.astype(np.float64) @ m.T.astype(np.float64)
        assert np.abs(got - ref).max() < 0.02 * np.abs(ref).max()


# ---- GGUF files kept quantized --------------------------------------------------------------

@pytest.fixture(scope="module")
def default_gguf():
    from gguf import GGUFReader
    from jaxserve.model.loader.default_model import default_gguf_path
    from jaxserve.model.loader.gguf_file import read_gguf
    path = default_gguf_path()
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    cfg, wq = read_gguf(path, progress=False, keep_quantized=True)
    return path, file_bytes, cfg, wq


def test_default_gguf_resident_bytes(default_gguf):
    _, file_bytes, cfg, wq = default_gguf
    assert quant.weight_bytes(wq) <= 1.3 * file_bytes
    kinds = {leaf.kind for leaf in jax.tree_util.tree_leaves(wq, is_leaf=quant.is_quantized)
             if quant.is_quantized(leaf)}
    assert kinds == {"q4_1", "q8_0"}                   # Q4_1 layers, Q8_0 embedding
    specs = jax.tree_util.tree_leaves(param_specs(cfg), is_leaf=is_spec)
    leaves = jax.tree_util.tree_leaves(wq, is_leaf=quant.is_quantized)
    assert all(quant.is_quantized(w) == (len(s.shape) == 2) for s, w in zip(specs, leaves))


def test_default_gguf_in_step_equals_dequantized_at_load(default_gguf, default_model):
    """Each kept-quantized matrix of the real file, used in a jitted matmul, equals the
    gguf-dequantized (and q/k un-permuted) float weight the default loader builds (the
    session's float32 default model: load_model(None, quantization="none"))."""
    _, _, cfg, wq = default_gguf
    assert default_model.config.num_layers == cfg.num_layers
    wf = default_model.weights
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, cfg.hidden_size)), jnp.float32)
    mm = jax.jit(linear)
    for name in ("wq", "wk", "w_up"):
        for i in (0, cfg.num_layers - 1):
            got, want = mm(x, wq["layers"][i][name]), x @ wf["layers"][i][name]
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    ids = jnp.asarray([1, 500, 49151], jnp.int32)
    np.testing.assert_array_equal(np.asarray(wq["embed"][ids]), np.asarray(wf["embed"][ids]))


def test_gguf_quantization_needs_a_gguf_file(tmp_path):
    from jaxserve.model.loader.errors import CheckpointError
    from jaxserve.model.loader.load import load_model
    from model_utils import save_hf_model
    save_hf_model("llama_gqa", tmp_path)
    with pytest.raises(CheckpointError, match="needs a GGUF file"):
        load_model(str(tmp_path), progress=False, quantization="gguf")


# ---- engines on quantized weights -----------------------------------------------------------

def tiny_quantized(kind: str):
    """A tiny model (hidden 256 so Q4_K super-blocks fit) with every matrix quantized."""
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                      head_dim=64, vocab_size=512)
    w = jax.tree_util.tree_map(np.asarray, tiny_weights(cfg))
    if kind in ("int8", "fp8"):
        return cfg, quantize_weights(cfg, w, kind, act="none")
    qtype = {v: k for k, v in KINDS.items()}[kind]

    def one(spec, a):
        if len(spec.shape) != 2:
            return a
        m = a.T if spec.hf_transpose else a
        return as_qarray(gguf_bytes(np.ascontiguousarray(m), qtype), qtype, *m.shape)
    return cfg, jax.tree_util.tree_map(one, param_specs(cfg), w, is_leaf=is_spec)


def dequantized(cfg, w):
    def one(spec, a):
        if not quant.is_quantized(a):
            return a
        m = a.dequantize()
        return m.T if spec.hf_transpose else m
    return jax.tree_util.tree_map(one, param_specs(cfg), w, is_leaf=is_spec)


SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
             token_buckets=[64], num_kv_blocks=40)


def run_greedy(engine, prompts, n: int = 8) -> list[list[int]]:
    return core_greedy(engine, prompts, n)


@pytest.mark.parametrize("kind", ["q4_k", "int8"])
def test_engine_quantized_equals_float_of_same_values(kind):
    """The engine on quantized leaves generates what it generates on their
    dequantized float values (both step modes see the same pytree)."""
    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    cfg, wq = tiny_quantized(kind)
    prompts = random_prompts(4, cfg.vocab_size, 5, 30, seed=5)
    ref = run_greedy(EngineCore(EngineArgs(**SMALL), cfg, dequantized(cfg, wq),
                                progress=False), prompts)
    for mode in ("layerwise", "fused"):
        eng = EngineCore(EngineArgs(**SMALL, step_mode=mode), cfg, wq, progress=False)
        assert run_greedy(eng, prompts) == ref, mode


@pytest.mark.parametrize("kind, platform", [("int8", "tpu"), ("int8", "cuda"),
                                            ("fp8", "tpu"), ("fp8", "cuda"),
                                            ("q4_k", "tpu"), ("q4_1", "cuda")])
def test_quantized_forward_lowers_for(kind, platform):
    """The quantized forward (int8 with int8 activations, the accelerators' path)
    lowers for TPU and CUDA from this CPU machine (jax.export)."""
    from jax import export
    from jaxserve.model import decoder
    cfg, wq = tiny_quantized(kind)
    if kind == "int8":
        wq = jax.tree_util.tree_map(
            lambda a: quant.QArray(a.kind, a.parts, a.shape, a.dtype, "int8")
            if quant.is_quantized(a) else a, wq, is_leaf=quant.is_quantized)

    def logits(w, toks):
        x = w["embed"][toks]
        for layer in w["layers"]:
            x = x + decoder.mlp(x, layer) + linear(linear(x, layer["wv"]).repeat(2, -1),
                                                   layer["wo"])
        return decoder.compute_logits(w, x)
    exp = export.export(jax.jit(logits), platforms=[platform])(wq, jnp.zeros(4, jnp.int32))
    text = exp.mlir_module()
    assert "dot_general" in text
    if kind == "int8":
        assert "xi8>" in text and "xi32>" in text       # an int8 x int8 -> int32 dot
