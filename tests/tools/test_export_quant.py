"""The export check with quantized weights (jaxserve.tools.export_check --quantization
int8 / q8_0 / q4_0 / q4_1 / q4_k, tools/export_quant.py): in decode buckets the lowered
step for TPU and CUDA holds no dequantized weight matrix outside a custom call, the
int8 matrices and the GGUF blocks going to the Pallas quantized-matmul kernels; lowered
with the kernels off (XLA's dot), the same check fails and names the materialized
weights. SmolLM2 shapes, one device in this process, and TP=3 in a process of its own.

Truths used: the exported modules' text (StableHLO), and hand-written module snippets
for the scanner.
"""
from __future__ import annotations

import re

import jax
import pytest

from export_runs import run_exports
from jaxserve.tools import export_check, export_quant


def _run(capsys, monkeypatch, platform: str, *extra: str, quant: str = "int8"
         ) -> tuple[int, list[str]]:
    if platform == "tpu":      # export_check.main registers the chip; undone after the test
        tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
        if not hasattr(tpu_info, "registry"):
            pytest.skip("jax internals changed: no TPU info registry to patch")
        kind = jax.devices()[0].device_kind
        monkeypatch.setitem(tpu_info.registry, kind, tpu_info.registry.get(kind))
    rc = export_check.main(["--platform", platform, "--shape", "smollm2",
                            "--quantization", quant, *extra])
    out = capsys.readouterr().out
    print(out)
    return rc, [l for l in out.splitlines() if not l.startswith("#")]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_int8_step_keeps_weights_quantized(platform, capsys, monkeypatch):
    """The smallest (decode) bucket and one of 128 tokens (prefill): 7 kernel calls per
    layer (q, k, v, o, gate, up, down) at decode, none at prefill (XLA's dot there), one
    attention call per layer in both."""
    rc, lines = _run(capsys, monkeypatch, platform, "--max-tokens", "128", "--max-buckets", "2")
    assert rc == 0 and len(lines) == 2
    calls = []
    for line in lines:
        m = re.match(rf"OK {platform} tokens=(\d+) width=\d+ kernel_calls=30 quant_calls=(\d+)",
                     line)
        assert m, line
        calls.append((int(m.group(1)), int(m.group(2))))
    (small, at_decode), (large, at_prefill) = calls
    assert small <= 64 < large
    assert at_decode == 7 * 30 and at_prefill == 0


def test_bypassed_kernel_is_reported(capsys, monkeypatch):
    """--quant-kernel off: the decode bucket's weights are widened by XLA outside any
    kernel, and the check fails naming them."""
    rc, lines = _run(capsys, monkeypatch, "tpu", "--max-tokens", "64", "--max-buckets", "1",
                     "--quant-kernel", "off")
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith("FAIL tpu tokens=64 ")
    assert "dequantized weights outside a kernel" in lines[0]
    assert "stablehlo.convert tensor<576x576xbf16>" in lines[0]       # wq, widened


@pytest.mark.parametrize("platform,kind", [("tpu", "q4_1"), ("cuda", "q4_k")])
def test_block_step_keeps_weights_quantized(platform, kind, capsys, monkeypatch):
    """GGUF blocks: in the decode bucket the 7 projections of each of the 30 layers and
    the tied Q8_0 head go through the block kernel (Q4_K's K of 576 falls back to Q8_0
    as llama.cpp's files do; the kernel reads both), and no weight is widened."""
    rc, lines = _run(capsys, monkeypatch, platform, "--max-tokens", "64",
                     "--max-buckets", "1", quant=kind)
    assert rc == 0 and len(lines) == 1
    assert re.match(rf"OK {platform} tokens=\d+ width=\d+ kernel_calls=30 quant_calls=211 ",
                    lines[0]), lines[0]


def test_bypassed_block_kernel_is_reported(capsys, monkeypatch):
    rc, lines = _run(capsys, monkeypatch, "cuda", "--max-tokens", "64", "--max-buckets", "1",
                     "--quant-kernel", "off", quant="q8_0")
    assert rc == 1 and lines[0].startswith("FAIL cuda tokens=64 ")
    assert "stablehlo.convert tensor<576x576xf32>" in lines[0]        # wq's blocks, widened


TP_KINDS = {"int8": 210, "q4_0": 211}


@pytest.fixture(scope="module")
def tp3_exports() -> dict[str, tuple[int, list[str]]]:
    """{kind: (exit status, output lines)} of the TP=3 exports, both in one process of
    their own (simulated devices; export_runs.py)."""
    return run_exports({kind: ["--platform", "cuda", "--shape", "smollm2", "--tp", "3",
                               "--quantization", kind, "--max-tokens", "64",
                               "--max-buckets", "1"] for kind in TP_KINDS}, timeout=600)


@pytest.mark.parametrize("kind,calls", TP_KINDS.items())
def test_quantized_step_under_tensor_parallelism(tp3_exports, kind, calls):
    """TP=3 (its own process: simulated devices): every quantized projection's kernel runs
    per device in a shard_map region, and no weight, whole or per device, is widened
    (with GGUF blocks also the vocabulary-split Q8_0 head)."""
    rc, out = tp3_exports[kind]
    print("\n".join(out))
    assert rc == 0
    lines = [l for l in out if not l.startswith("#")]
    assert len(lines) == 1
    assert re.match(rf"OK cuda tokens=64 width=\d+ kernel_calls=30 quant_calls={calls} ",
                    lines[0])


MLIR = """
  func.func public @main(%arg0: tensor<64x32xi8>, %arg1: tensor<64xf32>, %arg2: tensor<8x32xbf16>) {
    %0 = stablehlo.custom_call @tpu_custom_call(%arg2, %arg0) {backend_config = "tensor<64x32xbf16>"} : (tensor<8x32xbf16>, tensor<64x32xi8>) -> tensor<8x64xbf16>
    %1 = stablehlo.dot_general %arg2, %q, contracting_dims = [1] x [1] : (tensor<8x32xi8>, tensor<64x32xi8>) -> tensor<8x64xi32>
    %2 = stablehlo.reshape %x : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  }
"""


def test_scanner_ignores_custom_calls_and_int8():
    """Custom call lines (operands, results and serialized bodies) and int8 values of a
    weight's shape are not materialized weights; a float one in any op is, either
    orientation."""
    assert export_quant.materialized(MLIR, {(64, 32)}) == []
    bad = MLIR + ("    %3 = stablehlo.convert %arg0 : (tensor<64x32xi8>) -> tensor<64x32xbf16>\n"
                  "    %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<64x32xbf16>) -> "
                  "tensor<32x64xbf16>\n")
    assert export_quant.materialized(bad, {(64, 32)}) == [
        "stablehlo.convert tensor<64x32xbf16>", "stablehlo.transpose tensor<64x32xbf16>",
        "stablehlo.transpose tensor<32x64xbf16>"]
    assert export_quant.materialized(bad, {(16, 32)}) == []


def test_kernel_calls_by_name():
    """The attention and quantized-matmul kernels share a custom call target: the
    kernel's name tells them apart, calls into private functions counted per call."""
    mlir = """
  func.func public @main(%a: i32) {
    %0 = call @layer(%a) : (i32) -> i32
    %1 = call @layer(%0) : (i32) -> i32
  }
  func.func private @layer(%a: i32) {
    %0 = stablehlo.custom_call @tpu_custom_call(%a) {backend_config = "quant_matmul_int8"}
    %1 = stablehlo.custom_call @tpu_custom_call(%0) {backend_config = "attention"}
  }
"""
    assert export_check.count_kernel_calls(mlir, "tpu_custom_call") == 4
    assert export_check.count_kernel_calls(mlir, "tpu_custom_call", "quant_matmul_int8") == 2
