"""The page-major TPU kernel (kernel_tpu_pm.py) inside the engine's step, selected with
pallas_backend.TPU_KERNEL = "pm" (the engine's cache stays head-major; the backend
converts each layer's cache around the kernel):

* a decoder layer with the fused update (TPU interpreter) gives the reference path's
  output and caches, unsharded and under shard_map with the KV heads over 2 devices;
* the engine's fused step for Llama-3-8B at TP=8 exports for TPU with one page-major
  kernel call per layer and no KV scatter.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import tiny_config, tiny_weights
from jaxserve.attention import backends, pallas_backend, reference
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.model import decoder
from jaxserve.model.layers import rope_inv_freq
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.shard import ShardingPlan
from kernels_pallas.ragged_paged_attention.cases import make_case

ATOL = 1e-4     # float32 layer outputs |y| ~ 40 summed in another order than the reference


@pytest.fixture(autouse=True)
def pm_kernel(monkeypatch):
    monkeypatch.setattr(pallas_backend, "TPU_KERNEL", "pm")


def _inputs(cfg):
    K, H = cfg.num_kv_heads, cfg.head_dim
    case = make_case(np.random.default_rng(3), [5, 1, 1, 9], [11, 20, 0, 0], num_tokens=24,
                     num_rows=6, num_kv_heads=K, group=cfg.num_heads // K, head_dim=H,
                     block_size=16, pages=2, num_blocks=12)
    slots = jnp.asarray(case.slot_mapping)
    NB, bs = case.k_cache.shape[1], case.k_cache.shape[2]
    junk = [c.reshape(K, NB * bs, H).at[:, slots].set(val, mode="drop").reshape(c.shape)
            for c, val in ((case.k_cache, 7.0), (case.v_cache, -3.0))]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((24, cfg.hidden_size)),
                    jnp.float32)
    return case, x, junk, AttentionMetadata(**case.metadata_fields())


def _layer(cfg, attn_fn, x, caches, md):
    layer = tiny_weights(cfg)["layers"][0]
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    return jax.jit(lambda x, k, v: decoder.decoder_layer(x, layer, k, v, md, cfg, inv_freq,
                                                         attn_fn))(x, *caches)


def _same(case, got, want):
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got[0][:n]), np.asarray(want[0][:n]), atol=ATOL,
                               rtol=2e-5)
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("tp", [1, 2])
def test_decoder_layer_with_pm_kernel_matches_reference(tp):
    cfg = tiny_config(head_dim=128)
    case, x, junk, md = _inputs(cfg)
    want = _layer(cfg, reference.paged_attention, x, junk, md)
    fused = functools.partial(pallas_backend.paged_attention_update, interpret=True)
    caches = junk
    if tp > 1:
        plan = ShardingPlan.build(cfg, make_mesh(tensor_parallel_size=tp), log_summary=False)
        fused = plan.shard_attention(fused, writes_kv=True)
        caches = [jax.device_put(c, plan.kv_sharding()) for c in junk]
    got = _layer(cfg, backends.KVWritingAttention(fused), x, caches, md)
    _same(case, got, want)
    assert not np.array_equal(np.asarray(want[1]), np.asarray(junk[0]))
    assert backends.writes_kv(pallas_backend.make_attn_fn("tpu"))


def test_exported_llama3_tp8_step_runs_the_pm_kernel():
    from jaxserve.tools import export_check as mod
    mod.pretend_tpu("v5e")
    ns = mod.parse_args(["--platform", "tpu", "--shape", "llama3-8b", "--tp", "8",
                         "--num-blocks", "64"])
    target = mod.Target(ns)
    t, p = mod.pick_buckets(target.buckets.all_shapes(), 1)[0]
    mlir = target.export(t, p)["step"]
    assert mod.count_kernel_calls(mlir, mod.KERNEL_TARGETS["tpu"]) == 32
    assert "ragged_paged_attention_tpu_pm" in mlir
    assert "ragged_paged_attention_tpu_v3" not in mlir
    assert not re.search(r"stablehlo\.scatter.{0,200}update_window_dims = \[0, 2\], "
                         r"inserted_window_dims = \[1\]", mlir)
