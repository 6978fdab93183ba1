"""The engine with model/linear.py's QuantKernelLinear (the TPU / GPU choice for int8
and GGUF-block weights) on this CPU, its Pallas kernels in interpret mode: the fused
step's decode buckets multiply every quantized projection and the head through a
kernel, the prefill bucket through XLA's dot, and greedy tokens equal those of the
engine on XLA's dot alone over the same weights.

Truths used: the one-device engine on XLA's dot (model/quant.py's matmul); GGUF blocks
from gguf-py's quantizer (tests/model/test_quantization.py's tiny_quantized).
"""
from __future__ import annotations

import dataclasses

import pytest

from engine_utils import core_greedy, random_prompts, tiny_config, tiny_weights
from jaxserve.model.linear import QuantKernelLinear
from jaxserve.model.params import quantize_weights

ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
            token_buckets=[8, 64], num_kv_blocks=40, cpu_matmul_kernel="off",
            step_mode="fused")


@pytest.fixture(scope="module")
def int8_reference():
    """The int8 model, prompts and the XLA-dot engine's greedy tokens, computed once for
    both kernel backends."""
    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    cfg = tiny_config()
    w = quantize_weights(cfg, tiny_weights(cfg), "int8")      # embedding and head too
    prompts = random_prompts(3, cfg.vocab_size, 5, 20, seed=11)
    ref = core_greedy(EngineCore(EngineArgs(**ARGS), cfg, w, progress=False), prompts, 6)
    return cfg, w, prompts, ref


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_engine_on_quant_kernel_matches_xla_dot(int8_reference, backend):
    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    cfg, w, prompts, ref = int8_reference
    lin = QuantKernelLinear(backend, max_rows=8, interpret=True)
    eng = EngineCore(EngineArgs(**ARGS), dataclasses.replace(cfg, linear=lin), w,
                     progress=False)
    assert eng.runner.cfg.linear == lin
    assert core_greedy(eng, prompts, 6) == ref


@pytest.mark.slow
@pytest.mark.parametrize("backend,kind", [("tpu", "q4_k"), ("gpu", "q4_1")])
def test_engine_on_block_kernel_matches_xla_dot(backend, kind):
    """Every matrix in GGUF blocks (the embedding and the tied head included)."""
    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    from test_quantization import tiny_quantized
    cfg, w = tiny_quantized(kind)
    assert w["layers"][0]["w_down"].kind == kind
    prompts = random_prompts(3, cfg.vocab_size, 5, 20, seed=12)
    ref = core_greedy(EngineCore(EngineArgs(**ARGS), cfg, w, progress=False), prompts, 6)
    lin = QuantKernelLinear(backend, max_rows=8, interpret=True)
    eng = EngineCore(EngineArgs(**ARGS), dataclasses.replace(cfg, linear=lin), w,
                     progress=False)
    assert core_greedy(eng, prompts, 6) == ref
