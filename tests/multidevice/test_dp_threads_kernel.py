"""Data-parallel replicas as threads at TP=1 (8 simulated CPU devices) take the same
single-device paths as one unsharded engine: the C++ CPU attention and matmul kernels
and asynchronous scheduling (a one-device plan splits nothing; parallel/shard.py
spans_devices), each replica on its own device, with greedy outputs equal to
transformers'. Before, any plan meant the jnp reference attention, so threads and
processes were not compared like for like.
"""
from __future__ import annotations

import pytest

import jax

from engine_utils import hf_greedy, hf_model_from_weights, tiny_config, tiny_weights
from jaxserve.config import EngineArgs
from jaxserve.core.data_parallel import DataParallelEngine, make_engine
from jaxserve.request import Request
from jaxserve.sampling.params import SamplingParams
from kernels_cpu.ragged_paged_attention import build


def test_tp1_replicas_use_the_cpu_kernels_and_match_transformers():
    if not build.available():
        pytest.skip("no C++ compiler: the CPU kernels are not built here")
    assert jax.device_count() == 8
    cfg = tiny_config()
    weights = tiny_weights(cfg)
    args = EngineArgs(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                      token_buckets=[1, 32], num_kv_blocks=32, block_size=16,
                      data_parallel_size=2)
    dp = make_engine(args, cfg, weights, warmup=False, progress=False)
    assert isinstance(dp, DataParallelEngine)
    assert [r.backend.name for r in dp.replicas] == ["cpu", "cpu"]
    assert all(r.cpu_matmul for r in dp.replicas)
    assert all(r.step_config.host_order == "async" for r in dp.replicas)
    devices = [{d.id for d in r.runner.kv[0][0].devices()} for r in dp.replicas]
    assert devices == [{0}, {1}]
    prompts = [[5 + i] * (3 + i) + [40 + i] for i in range(6)]
    for i, p in enumerate(prompts):
        dp.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0,
                                                          ignore_eos=True)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while dp.has_unfinished_requests():
        for o in dp.step():
            out[o.req_id].extend(o.new_token_ids)
    assert min(r.stats.steps for r in dp.replicas) > 0      # both replicas worked
    dp.shutdown()
    model = hf_model_from_weights(cfg, weights)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(model, p, 6), f"prompt {i}"
