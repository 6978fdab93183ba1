"""kernels_pallas/quant_matmul/blocks.py: the weight-only matmul on GGUF blocks (Q8_0, Q4_0,
Q4_1, Q4_K) in Pallas interpret mode against its jnp reference, both bodies (TPU: whole K
per block; GPU: a loop over K with masked loads, ragged last chunk), at decode row
counts; its TPU / CUDA lowering (jax.export from this CPU); and QuantKernelLinear, which
sends GGUF QArrays to it.

Truths used: real GGUF blocks written by gguf-py's quantizer (the file format's own
code), model/quant.py's dequantization (itself checked against gguf-py's), the float32
dot of the dequantized matrix, and the exported module's text.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import export_target
from kernels_pallas.quant_matmul import blocks
from kernels_pallas.quant_matmul.ref import block_matmul_ref, dequantize_blocks
from jaxserve.model import linear as linear_mod
from jaxserve.model.quant import QArray
from tpu_export import pretend_tpu_v5e

KINDS = blocks.KINDS


def gguf_qarray(kind: str, n: int, k: int, seed: int = 0) -> QArray:
    """A random [n, k] matrix as real block bytes read by the loader: quantized by gguf-py
    (Q8_0, Q4_0, Q4_1), or random but valid Q4_K blocks (gguf-py has no Q4_K quantizer):
    f16 d and dmin, random 6-bit scale bytes and 4-bit values."""
    from gguf import GGMLQuantizationType as T, quants
    from jaxserve.model.loader.gguf_file import quantized_parts
    qtype = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q4_k": T.Q4_K}[kind]
    rng = np.random.default_rng(seed)
    if kind == "q4_k":
        d = rng.uniform(1e-3, 2e-2, (n * k // 256, 2)).astype(np.float16).view(np.uint8)
        rest = rng.integers(0, 256, (n * k // 256, 140), dtype=np.uint8)
        raw = np.concatenate([d, rest], axis=1).reshape(n, -1)
    else:
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qtype)
    parts = quantized_parts(raw, qtype, n, k)
    return QArray(kind, {name: jnp.asarray(v) for name, v in parts.items()}, (n, k))


# (m, n, k, block_n): K of 256 and 768 leave the GPU body's last chunk partial (Q4_K's
# scale blocks included); N not a multiple of the block
CASES = [(1, 40, 256, None), (3, 300, 768, 128), (8, 72, 512, 32), (5, 17, 1024, None)]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_interpret_matches_reference(kind, backend):
    for i, (m, n, k, bn) in enumerate(CASES):
        w = gguf_qarray(kind, n, k, seed=i)
        x = jnp.asarray(np.random.default_rng(10 + i).standard_normal((m, k)), jnp.float32)
        out = blocks.block_matmul(x, w.parts, kind=kind, n=n, backend=backend,
                                  interpret=True, block_n=bn)
        ref = block_matmul_ref(x, kind, w.parts)
        assert out.shape == (m, n) and out.dtype == x.dtype
        # float32 sums in another order: within a few ulps of the largest output
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5,
                                   atol=2e-6 * scale)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_dequantizes_like_the_model(kind):
    """The kernels' reference (written out in K order) and model/quant.py's
    dequantization give the same matrix, bit for bit."""
    w = gguf_qarray(kind, 24, 512, seed=3)
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(kind, w.parts)),
                                  np.asarray(w.dequantize(jnp.float32)))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_bf16_activations(backend):
    """bf16 x: the tile is cast to bf16 as the model's XLA path casts the dequantized
    matrix, products summed in float32."""
    w = gguf_qarray("q4_k", 200, 512, seed=5)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 512)), jnp.bfloat16)
    out = blocks.block_matmul(x, w.parts, kind="q4_k", n=200, backend=backend,
                              interpret=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(block_matmul_ref(x, "q4_k", w.parts), np.float32),
                               rtol=2e-2, atol=2e-2)


def test_bad_parts_are_refused():
    w = gguf_qarray("q4_1", 32, 256)
    with pytest.raises(ValueError, match="do not fit"):
        blocks.block_matmul(jnp.zeros((1, 512)), w.parts, kind="q4_1", n=32, backend="gpu")
    with pytest.raises(ValueError, match="backend"):
        blocks.block_matmul(jnp.zeros((1, 256)), w.parts, kind="q4_1", n=32, backend="cpu")
    assert blocks.tpu_block_n(14336, 4096) == 256 and blocks.tpu_block_n(300, 576) == 300
    assert blocks.tpu_block_n(4096, 14336) == 128


def _abstract(kind: str, n: int, k: int) -> dict:
    from kernels_pallas.quant_matmul.blocks import part_layout
    return {name: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
            for name, shape, dt in part_layout(kind, n, k)}


LOWER = [("tpu", "q4_k", 8, 14336, 4096), ("tpu", "q8_0", 3, 4096, 14336),
         ("tpu", "q4_1", 64, 576, 1536), ("cuda", "q4_0", 8, 14336, 4096),
         ("cuda", "q4_k", 1, 4096, 14336), ("cuda", "q8_0", 64, 49152, 576)]


@pytest.mark.parametrize("platform,kind,m,n,k", LOWER,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}x{c[4]}" for c in LOWER])
def test_lowers_for_accelerators(platform, kind, m, n, k, monkeypatch):
    """Pallas -> Mosaic / Triton lowering at Llama-3-8B and SmolLM2 shapes: one custom
    call, named, reading the stored values (int8 / packed uint8) themselves; no float
    matrix of the weight's shape anywhere in the module."""
    from jax import export
    if platform == "tpu":
        pretend_tpu_v5e(monkeypatch)
    target = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}[platform]
    fn = jax.jit(functools.partial(blocks.block_matmul, kind=kind, n=n,
                                   backend="tpu" if platform == "tpu" else "gpu"))
    ctx = export_target.cuda() if platform == "cuda" else contextlib.nullcontext()
    with ctx:
        text = export.export(fn, platforms=[platform], disabled_checks=[
            export.DisabledSafetyCheck.custom_call(target)])(
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16), _abstract(kind, n, k)
        ).mlir_module()
    calls = [l for l in text.splitlines() if f"@{target}" in l]
    assert len(calls) == 1 and blocks.KERNEL_NAME in calls[0]
    values = f"tensor<{n}x{k}xi8>" if kind == "q8_0" else f"tensor<{n}x{k // 2}xui8>"
    assert values in calls[0]
    for t in ("bf16", "f32"):
        assert f"tensor<{n}x{k}x{t}>" not in text and f"tensor<{k}x{n}x{t}>" not in text


# ---- QuantKernelLinear ------------------------------------------------------------------

@pytest.mark.parametrize("backend,kind", [("tpu", "q4_k"), ("gpu", "q4_1"), ("gpu", "q8_0")])
def test_linear_routes_block_weights_to_kernel(backend, kind):
    """Up to max_rows rows a GGUF QArray goes through the block kernel, with the values
    of XLA's dequantize-and-dot; more rows keep XLA's dot; the tied head too."""
    lin = linear_mod.QuantKernelLinear(backend, max_rows=8, interpret=True)
    w = gguf_qarray(kind, 72, 512, seed=2)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 512)), jnp.float32)
    assert lin.takes(x, w) and not lin.takes(jnp.zeros((9, 512)), w)
    out = lin(x, w)
    assert out.shape == (2, 3, 72)
    ref = linear_mod.XLA_LINEAR(x, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5,
                               atol=2e-6 * float(jnp.max(jnp.abs(ref))))
    np.testing.assert_allclose(np.asarray(lin.tied(x[0], w)), np.asarray(out[0]),
                               rtol=1e-6, atol=1e-6)
    assert "pallas_call" in str(jax.make_jaxpr(lin)(x, w))
    assert not lin.takes(x, dataclasses.replace(w, act="int8"))


def test_linear_under_a_mesh_needs_whole_blocks_per_device():
    """Under a mesh a block weight split by rows, or by columns into whole blocks, runs
    per device; a column split that would cut the scales' axis keeps XLA's dot."""
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    lin = linear_mod.QuantKernelLinear("gpu", interpret=True, mesh=mesh)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 512)), jnp.float32)
    for split in (("model", None), (None, "model")):
        w = dataclasses.replace(gguf_qarray("q4_k", 72, 512), split=split)
        assert lin.takes(x, w)
        assert "shard_map" in str(jax.make_jaxpr(lin)(x, w))
        ref = linear_mod.XLA_LINEAR(x, w)
        np.testing.assert_allclose(np.asarray(lin(x, w)), np.asarray(ref), rtol=2e-5,
                                   atol=2e-6 * float(jnp.max(jnp.abs(ref))))

    class Three:                 # a 3-way column split: 2 super-blocks do not divide
        shape = {"model": 3}
    three = dataclasses.replace(lin, mesh=Three())
    assert not three.takes(x, dataclasses.replace(gguf_qarray("q4_k", 72, 512),
                                                  split=(None, "model")))
    assert three.takes(x, dataclasses.replace(gguf_qarray("q4_k", 72, 512),
                                              split=("model", None)))
