"""The default model's start-up cache holds its GGUF's own quantized blocks, and
load_model serves them (or, asked for float, dequantizes them to exactly the values the
GGUF file gives).

Truths: gguf-py's quantize / dequantize, and the GGUF file read by gguf_file.read_gguf
(its blocks kept, or dequantized).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors import safe_open

from jaxserve.model import quant
from jaxserve.model.loader import blocks, default_model
from jaxserve.model.loader.load import load_model
from jaxserve.model.loader.gguf_file import quantized_parts, read_gguf
from jaxserve.model.loader.safetensors_dir import load_safetensors_dir, save_safetensors_dir
from jaxserve.model.params import quantize_weights
from jaxserve.model.quant import QArray
from engine_utils import tiny_config, tiny_weights

MiB = 2**20


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def _same(a, b) -> list[str]:
    """Paths whose leaves differ (structure must match)."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    return [jax.tree_util.keystr(k) for (k, x), (_, y) in zip(_leaves(a), _leaves(b))
            if not np.array_equal(np.asarray(x), np.asarray(y))]


@pytest.mark.parametrize("qtype,kind", [(Q.Q8_0, "q8_0"), (Q.Q4_0, "q4_0"), (Q.Q4_1, "q4_1")])
def test_blocks_dequantize_exactly_like_gguf(qtype, kind):
    rows, cols = 24, 96
    m = np.random.default_rng(0).normal(0, 0.05, (rows, cols)).astype(np.float32)
    raw = quantize(m, qtype)
    q = QArray(kind, quantized_parts(raw, qtype, rows, cols), (rows, cols))
    want = dequantize(raw, qtype).reshape(rows, cols)
    got = blocks.dequantize(q)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_quantized_safetensors_round_trip(tmp_path):
    """Any QArray kind goes through save_safetensors_dir(keep_quantized=True) and back,
    part for part; a float reader gets the dequantized matrices."""
    cfg = tiny_config()
    w = tiny_weights(cfg)
    wq = quantize_weights(cfg, w, "int8")
    save_safetensors_dir(tmp_path, cfg, wq, keep_quantized=True)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as h:
        listed = blocks.entries(h.metadata())
    assert listed and all(e["kind"] == "int8" for e in listed.values())
    _, back = load_safetensors_dir(tmp_path, "float32", False, keep_quantized=True)
    assert not _same(back, wq)
    _, f = load_safetensors_dir(tmp_path, "float32", False)
    wq0 = wq["layers"][0]["w_up"]
    assert np.array_equal(np.asarray(f["layers"][0]["w_up"]), np.asarray(wq0.dequantize()).T)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return default_model.default_model_path(root)


def test_default_cache_stores_the_files_blocks(converted):
    gguf = default_model.default_gguf_path()
    st = converted / "model.safetensors"
    # the file's bytes, not float32 (that was 513 MiB)
    assert st.stat().st_size < gguf.stat().st_size + 2 * MiB
    with safe_open(str(st), framework="numpy") as h:
        listed = blocks.entries(h.metadata())
        floats = [k for k in h.keys() if h.get_slice(k).get_dtype() == "F32"]
        assert all(len(h.get_slice(k).get_shape()) == 1 for k in floats)     # norms only
    kinds = {e["kind"] for e in listed.values()}
    assert kinds == {"q4_1", "q8_0"} and len(listed) == 30 * 7 + 1
    _, kept = read_gguf(gguf, progress=False, keep_quantized=True)
    _, wq = load_safetensors_dir(converted, "float32", False, keep_quantized=True)
    assert not _same(wq, kept)
    _, dense = read_gguf(gguf, progress=False)
    _, wf = load_safetensors_dir(converted, "float32", False)
    assert not _same(wf, dense)         # float32 on request: bit for bit the GGUF's values


def test_load_model_default_serves_blocks():
    m = load_model(None, progress=False, skip_tokenizer=True)
    layer = m.weights["layers"][0]
    assert m.format == "safetensors"
    assert isinstance(layer["w_up"], QArray) and layer["w_up"].kind == "q4_1"
    assert isinstance(m.weights["embed"], QArray) and m.weights["embed"].kind == "q8_0"
    assert quant.weight_bytes(m.weights) <= 120 * MiB
    f = load_model(None, progress=False, skip_tokenizer=True, quantization="none")
    assert not quant.is_quantized(f.weights["layers"][0]["w_up"])
    assert f.weights["layers"][0]["w_up"].dtype == np.float32
    i8 = load_model(None, progress=False, skip_tokenizer=True, quantization="int8")
    assert i8.weights["layers"][0]["w_up"].kind == "int8"
