"""Quantized weights under tensor parallelism (8 simulated CPU devices): a TP=2 engine on
quantized leaves, and the int8 KV cache at TP=2 and TP=4, generate what one device
generates (the rest: tests/model/test_quantization.py)."""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import pytest

from engine_utils import random_prompts
from jaxserve.config import EngineArgs
from jaxserve.core.engine_core import EngineCore
from test_quantization import SMALL, run_greedy, tiny_quantized


@pytest.fixture(scope="module")
def one_device() -> Callable[..., Any]:
    """(cfg, quantized weights, prompts, the unsharded engine's greedy tokens) per
    quantization kind and KV dtype, built once for the module: several TPs and linear
    forms below compare with the same one-device engine."""
    models: dict[str, Any] = {}
    refs: dict[tuple[str, str], Any] = {}

    def get(kind: str, kv_cache_dtype: str = "auto"):
        if kind not in models:
            cfg, wq = tiny_quantized(kind)
            models[kind] = cfg, wq, random_prompts(4, cfg.vocab_size, 5, 30, seed=6)
        cfg, wq, prompts = models[kind]
        if (kind, kv_cache_dtype) not in refs:
            refs[kind, kv_cache_dtype] = run_greedy(EngineCore(
                EngineArgs(**SMALL, kv_cache_dtype=kv_cache_dtype), cfg, wq,
                progress=False), prompts)
        return cfg, wq, prompts, refs[kind, kv_cache_dtype]
    return get


@pytest.mark.parametrize("kind", ["q4_1", "int8"])
def test_tp2_quantized_equals_tp1(one_device, kind):
    cfg, wq, prompts, ref = one_device(kind)
    eng = EngineCore(EngineArgs(**SMALL, tensor_parallel_size=2), cfg, wq, progress=False)
    parts = eng.runner.weights["layers"][0]["w_up"].parts
    assert not parts["p" if kind == "q4_1" else "q"].sharding.is_fully_replicated
    assert run_greedy(eng, prompts) == ref


@pytest.mark.parametrize("tp", [2, 4])
def test_int8_kv_cache_tp_equals_tp1(one_device, tp):
    """int8 KV cache under TP: at TP=2 the 2 KV heads (values and scales) are split,
    at TP=4 each rank holds its own copy of one (kv_head_replicas): greedy outputs
    equal the unsharded int8-KV engine's."""
    cfg, wq, prompts, ref = one_device("int8", "int8")
    eng = EngineCore(EngineArgs(**SMALL, kv_cache_dtype="int8", tensor_parallel_size=tp),
                     cfg, wq, progress=False)
    k = eng.runner.kv[0][0]
    assert k.values.dtype == jnp.int8
    assert k.values.addressable_shards[0].data.shape[0] == 1      # one KV head per rank
    assert k.scales.addressable_shards[0].data.shape[0] == 1
    assert run_greedy(eng, prompts) == ref


@pytest.mark.parametrize("tp,kind", [(2, "int8"), (4, "int8"), (2, "q4_k")])
def test_quant_kernel_per_device_equals_tp1(one_device, tp, kind):
    """model/linear.py's QuantKernelLinear under a plan (the TPU / GPU engine's choice, its
    Pallas kernels in interpret mode here): each quantized projection runs per device
    under shard_map by the split the plan gave it (q / k / v and gate / up: output
    channels; o and down: input columns, partial products summed); greedy outputs equal
    the unsharded engine's on XLA's dot. Q4_K: o's 128 columns per device hold half a
    super-block, so o keeps XLA's dot and down (256 per device) takes the kernel."""
    import dataclasses
    from jaxserve.model.linear import QuantKernelLinear
    from jaxserve.parallel.shard import mesh_and_rules_from_args
    cfg, wq, prompts, ref = one_device(kind)
    args = EngineArgs(**SMALL, tensor_parallel_size=tp, cpu_matmul_kernel="off")
    mesh = mesh_and_rules_from_args(args)[0]
    lin = QuantKernelLinear("tpu", interpret=True, mesh=mesh)
    eng = EngineCore(args, dataclasses.replace(cfg, linear=lin), wq, progress=False)
    layer = eng.runner.weights["layers"][0]
    assert eng.runner.cfg.linear == lin
    assert layer["wq"].split == layer["w_up"].split == ("model", None)
    assert layer["wo"].split == layer["w_down"].split == (None, "model")
    x = jnp.zeros((4, cfg.intermediate_size), jnp.float32)
    assert lin.takes(x, layer["w_down"])
    assert lin.takes(x[:, :cfg.hidden_size], layer["wo"]) == (kind == "int8")
    assert run_greedy(eng, prompts) == ref
