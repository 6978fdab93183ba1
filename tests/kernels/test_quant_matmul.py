"""kernels_pallas/quant_matmul: the weight-only int8 matmul in Pallas interpret mode against
its jnp reference (dequantize, then a float32 dot), both bodies (TPU grid-over-K with a
VMEM accumulator; GPU loop over K with masked loads), at decode row counts and shapes
that are not multiples of the blocks; its TPU / CUDA lowering (jax.export from this CPU);
and QuantKernelLinear, the model's implementation that sends int8 weights to it.

Truths used: the reference (float32 math over the same int8 values), XLA's dot path of
model/quant.py, and the exported module's text.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import export_target
from kernels_pallas.quant_matmul import kernel, tuning
from kernels_pallas.quant_matmul.ref import int8_matmul_ref
from jaxserve.model import linear as linear_mod
from jaxserve.model.quant import QArray, quantize_matrix
from tpu_export import pretend_tpu_v5e


def _case(m: int, n: int, k: int, seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    q = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    s = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    return x, q, s


# (m, n, k, blocks): small blocks force several N and K blocks with ragged last ones
# (n, k not multiples of the block); None: the tuned blocks, cut to the whole matrix
CASES = [(1, 40, 72, None), (3, 300, 200, (128, 128)), (8, 96, 130, (32, 64)),
         (3, 17, 300, (16, 128)), (8, 1000, 200, None)]


@pytest.mark.parametrize("backend", kernel.BACKENDS)
@pytest.mark.parametrize("m,n,k,blocks", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in CASES])
def test_interpret_matches_reference(backend, m, n, k, blocks):
    x, q, s = _case(m, n, k, seed=m * n + k)
    out = kernel.int8_matmul(x, q, s, backend=backend, interpret=True, blocks=blocks)
    ref = int8_matmul_ref(x, q, s)
    assert out.shape == (m, n) and out.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", kernel.BACKENDS)
def test_interpret_bf16_activations(backend):
    """bf16 x (the accelerators' dtype): the tile is widened to bf16, products summed in
    float32; within bf16 rounding of the reference."""
    x, q, s = _case(8, 200, 384, seed=3, dtype=jnp.bfloat16)
    out = kernel.int8_matmul(x, q, s, backend=backend, interpret=True, blocks=(128, 128))
    ref = int8_matmul_ref(x.astype(jnp.float32), q, s)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref),
                               rtol=2e-2, atol=2e-2)


def test_blocks_fit_the_backend():
    assert kernel.blocks_for("tpu", 4096, 14336) == tuning.BLOCKS["tpu"]
    assert kernel.blocks_for("tpu", 300, 200) == (300, 200)       # whole dims: legal
    assert kernel.blocks_for("gpu", 4096, 14336) == tuning.BLOCKS["gpu"]
    assert kernel.blocks_for("gpu", 17, 10) == (32, 16)            # powers of two >= 16
    with pytest.raises(ValueError):
        kernel.int8_matmul(*_case(1, 8, 16), backend="cpu")


LOWER = [("tpu", 8, 14336, 4096), ("tpu", 3, 4096, 14336), ("tpu", 64, 576, 1000),
         ("cuda", 8, 14336, 4096), ("cuda", 1, 1000, 200)]


@pytest.mark.parametrize("platform,m,n,k", LOWER, ids=[f"{p}-{m}x{n}x{k}" for p, m, n, k in LOWER])
def test_lowers_for_accelerators(platform, m, n, k, monkeypatch):
    """Pallas -> Mosaic / Triton lowering at Llama-3-8B projection shapes and ragged
    ones: one custom call, named, reading the int8 matrix itself (not the compilers)."""
    from jax import export
    if platform == "tpu":
        pretend_tpu_v5e(monkeypatch)
    target = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}[platform]
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(functools.partial(kernel.int8_matmul,
                                   backend="tpu" if platform == "tpu" else "gpu"))
    ctx = export_target.cuda() if platform == "cuda" else _nullcontext()
    with ctx:
        text = export.export(fn, platforms=[platform], disabled_checks=[
            export.DisabledSafetyCheck.custom_call(target)])(
            sds((m, k), jnp.bfloat16), sds((n, k), jnp.int8), sds((n,), jnp.float32)
        ).mlir_module()
    calls = [l for l in text.splitlines() if f"@{target}" in l]
    assert len(calls) == 1 and kernel.KERNEL_NAME in calls[0]
    assert f"tensor<{n}x{k}xi8>" in calls[0]
    assert f"tensor<{n}x{k}xbf16>" not in text


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


# ---- QuantKernelLinear ------------------------------------------------------------------

def _qarray(n: int, k: int, act: str = "none", kind: str = "int8") -> QArray:
    m = np.random.default_rng(7).standard_normal((n, k)).astype(np.float32)
    return quantize_matrix(m, kind, jnp.float32, act).map_parts(lambda _, p: jnp.asarray(p))


@pytest.mark.parametrize("backend", kernel.BACKENDS)
def test_linear_routes_int8_decode_rows_to_kernel(backend):
    """Up to max_rows rows an int8 weight-only QArray goes through the kernel (same values
    as XLA's dequantize-and-dot); more rows, int8 activations, fp8 and float weights
    keep XLA's dot."""
    lin = linear_mod.QuantKernelLinear(backend, max_rows=8, interpret=True)
    w = _qarray(72, 48)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 48)), jnp.float32)
    assert lin.takes(x, w)
    out = lin(x, w)
    assert out.shape == (2, 3, 72)
    np.testing.assert_allclose(np.asarray(out), np.asarray(linear_mod.XLA_LINEAR(x, w)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lin.tied(x[0], w)), np.asarray(out[0]),
                               rtol=1e-6, atol=1e-6)
    assert not lin.takes(jnp.zeros((9, 48)), w)
    assert not lin.takes(x, _qarray(72, 48, act="int8"))
    assert not lin.takes(x, _qarray(72, 48, kind="fp8"))
    assert not lin.takes(x, jnp.zeros((48, 72)))
    jaxpr = str(jax.make_jaxpr(lin)(x, w))
    assert "pallas_call" in jaxpr
    assert "pallas_call" not in str(jax.make_jaxpr(lin)(jnp.zeros((16, 48)), w))


def test_engine_choice_per_platform():
    """The engine's choice: the kernel on one TPU / GPU, XLA's dot on CPU and sharded."""
    assert linear_mod.for_platform("cpu", sharded=False) is linear_mod.XLA_LINEAR
    assert linear_mod.for_platform("tpu", sharded=True) is linear_mod.XLA_LINEAR
    assert linear_mod.for_platform("tpu", sharded=False) == linear_mod.QuantKernelLinear("tpu")
    assert linear_mod.for_platform("gpu", sharded=False) == linear_mod.QuantKernelLinear("gpu")
    assert linear_mod.QuantKernelLinear("gpu") != linear_mod.XLA_LINEAR
    assert not linear_mod.QuantKernelLinear("gpu").cpu_kernels


def test_linear_under_a_mesh_runs_per_device():
    """With a mesh, a weight the plan split one way runs the kernel inside shard_map
    (a custom call has no partitioning); one split both ways, or never placed by a
    plan, keeps XLA's dot. The numbers under several devices: tests/multidevice/
    test_quantization_devices.py."""
    import dataclasses
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    lin = linear_mod.QuantKernelLinear("gpu", interpret=True, mesh=mesh)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 48)), jnp.float32)
    for split in (("model", None), (None, "model")):
        w = dataclasses.replace(_qarray(72, 48), split=split)
        assert lin.takes(x, w)
        jaxpr = str(jax.make_jaxpr(lin)(x, w))
        assert "shard_map" in jaxpr and "pallas_call" in jaxpr
        np.testing.assert_allclose(np.asarray(lin(x, w)),
                                   np.asarray(linear_mod.XLA_LINEAR(x, w)), rtol=1e-5,
                                   atol=1e-5)
    assert not lin.takes(x, dataclasses.replace(_qarray(72, 48), split=("model", "model")))
    assert not lin.takes(x, _qarray(72, 48))
    assert linear_mod.for_platform("tpu", sharded=True, mesh=mesh) == \
        linear_mod.QuantKernelLinear("tpu", mesh=mesh)
