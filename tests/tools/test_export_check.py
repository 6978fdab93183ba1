"""jaxserve.tools.export_check: the engine's fused step exports for TPU and CUDA from this CPU.

The four CI configurations at Llama-3-8B shapes, each on 3 of its buckets (smallest,
middle, largest; the script's default is every bucket): TPU v5e TP=8, TPU DP=2 x TP=4,
CUDA TP=1, CUDA TP=8; and the multi-step decode, Gemma and LoRA exports below. Simulated
devices need XLA_FLAGS before jax is imported, so the exports run in a process of their
own: one process for all of them (their start-up, jax's import and the tool's set-up
are most of a small export's cost), calling the tool's main() once per configuration.
Its first configuration needs the most devices (8): that call sets the device count
before jax is imported (ensure_devices, as the command line does), and every later
configuration builds its mesh from the first TP x DP of those devices, as the tool does
on a host with more devices than it needs.
"""
from __future__ import annotations

import re

import pytest

from export_runs import run_exports

CI_CONFIGS = [("tpu", 8, 1), ("tpu", 4, 2), ("cuda", 1, 1), ("cuda", 8, 1)]
CI_BUCKETS = 3
GEMMA = [("tpu", "gemma3-4b", 4, 34), ("cuda", "gemma2-9b", 2, 42)]
LORA = [("tpu", 1), ("cuda", 3)]

# every export the tests below check, by name -> the tool's arguments; the first one
# needs the most devices, 8 (see above)
RUNS: dict[str, list[str]] = {
    **{f"ci-{p}-tp{t}-dp{d}": ["--platform", p, "--shape", "llama3-8b", "--tp", str(t),
                               "--dp", str(d), "--max-buckets", str(CI_BUCKETS)]
       for p, t, d in CI_CONFIGS},
    "multi-step": ["--platform", "tpu", "--shape", "llama3-8b", "--tp", "8",
                   "--max-buckets", "1", "--decode-steps", "4"],
    **{f"gemma-{s}": ["--platform", p, "--shape", s, "--tp", str(t), "--max-buckets", "1"]
       for p, s, t, _ in GEMMA},
    **{f"lora-{p}-tp{t}": ["--platform", p, "--shape", "smollm2", "--tp", str(t),
                           "--max-buckets", "2", "--enable-lora", "--max-loras", "8",
                           "--max-lora-rank", "8"] for p, t in LORA},
}

@pytest.fixture(scope="module")
def exports() -> dict[str, tuple[int, list[str]]]:
    """Every run of RUNS in one process (export_runs.py) -> {name: (exit status, its
    output lines)}."""
    return run_exports(RUNS, timeout=900)


def _export_lines(exports, name: str) -> list[str]:
    """The run's output (printed for a failure's report); it must succeed -> its result
    lines (one per bucket)."""
    rc, lines = exports[name]
    print("\n".join(lines))
    assert rc == 0
    return [l for l in lines if not l.startswith("#")]


def _script():
    from jaxserve.tools import export_check
    return export_check


@pytest.mark.parametrize("platform,tp,dp", CI_CONFIGS,
                         ids=[f"{p}-tp{t}-dp{d}" for p, t, d in CI_CONFIGS])
def test_ci_configuration_exports(exports, platform, tp, dp):
    lines = _export_lines(exports, f"ci-{platform}-tp{tp}-dp{dp}")
    assert len(lines) == CI_BUCKETS
    for line in lines:
        m = re.match(rf"OK {platform} tokens=(\d+) width=(\d+) kernel_calls=(\d+)", line)
        assert m, line
        assert int(m.group(3)) == 32          # one attention kernel per Llama-3-8B layer


def test_multi_step_decode_exports_for_tpu(exports):
    """The fused step's multi-step decode loop (--decode-steps) lowers for TPU under
    TP=8, the attention kernel once per layer in the loop's body."""
    lines = _export_lines(exports, "multi-step")
    assert len(lines) == 1
    m = re.match(r"OK tpu tokens=(\d+) width=(\d+) kernel_calls=(\d+)", lines[0])
    assert m and int(m.group(3)) == 32, lines[0]


def test_bucket_subset_keeps_both_ends():
    mod = _script()
    shapes = [(t, p) for t in (16, 32, 64) for p in (0, 8, 16)]
    assert mod.pick_buckets(shapes, 0) == shapes
    assert mod.pick_buckets(shapes, 3) == [(16, 0), (32, 8), (64, 16)]
    assert mod.pick_buckets(shapes, 1) == [(64, 16)]


def test_kernel_calls_follow_private_functions():
    """jax lowers a jitted callee once and calls it per layer: count the calls."""
    mod = _script()
    mlir = """
  func.func public @main(%a: i32) {
    %0 = call @layer(%a) : (i32) -> i32
    %1 = call @layer(%0) : (i32) -> i32
    %2 = stablehlo.custom_call @tpu_custom_call(%1)
  }
  func.func private @layer(%a: i32) {
    %0 = call @attn(%a) : (i32) -> i32
  }
  func.func private @attn(%a: i32) {
    %0 = stablehlo.custom_call @tpu_custom_call(%a)
  }
"""
    assert mod.count_kernel_calls(mlir, "tpu_custom_call") == 3
    assert mod.count_kernel_calls(mlir, "__gpu$xla.gpu.triton") == 0


@pytest.mark.parametrize("platform,shape,tp,layers", GEMMA, ids=[g[1] for g in GEMMA])
def test_gemma_sliding_window_shapes_export(exports, platform, shape, tp, layers):
    """Gemma's interleaved sliding-window / global layers, soft-caps (Gemma 2) and head_dim
    256 lower with the Pallas kernels, sharded: one kernel call per layer."""
    cfg = _script().model_config(shape)
    kinds = {cfg.layer_kind(i) for i in range(cfg.num_layers)}
    assert kinds == {"sliding_attention", "full_attention"}
    assert cfg.sliding_window and cfg.head_dim == 256
    lines = _export_lines(exports, f"gemma-{shape}")
    assert len(lines) == 1
    m = re.match(rf"OK {platform} tokens=\d+ width=\d+ kernel_calls=(\d+)", lines[0])
    assert m and int(m.group(1)) == layers, lines[0]


@pytest.mark.parametrize("platform,tp", LORA, ids=[f"{p}-tp{t}" for p, t in LORA])
def test_lora_step_exports(exports, platform, tp):
    """The fused step with LoRA slot arrays (8 adapters of rank 8) lowers at SmolLM2's
    shapes on the smallest and largest bucket: with 9 slots those take the gathered
    (CUDA: 8 tokens), masked (TPU: 64) and grouped (2048, 8192) forms of the delta
    (model/lora.py form), sharded with TP=3 on CUDA."""
    from jaxserve.model import lora as lora_model
    lines = _export_lines(exports, f"lora-{platform}-tp{tp}")
    assert len(lines) == 2
    forms = set()
    for line in lines:
        m = re.match(rf"OK {platform} tokens=(\d+) width=\d+ kernel_calls=30 lora=8x8 ", line)
        assert m, line
        forms.add(lora_model.form(int(m.group(1)), 9))
    assert forms == ({"gather", "blocked"} if platform == "cuda" else {"masked", "blocked"})
