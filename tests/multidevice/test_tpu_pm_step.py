"""The page-major TPU kernel (kernel_tpu_pm.py) inside the engine's step, with the cache
allocated page-major (--tpu-attention-kernel pm, attention/kv_layout.py):

* a decoder layer with the fused update (TPU interpreter) on a page-major layer gives
  the reference path's output and caches, unsharded and under shard_map with the KV
  heads over 2 devices;
* the plan shards a page-major cache on its 2K axis: one KV head (its K and V rows) per
  chip at TP=8, two at TP=4, for Llama-3-8B;
* the engine's fused step for Llama-3-8B at TP=8 (and TP=4) exports for TPU with one
  page-major kernel call per layer, no KV scatter, and no op but the kernel call and
  the shard_map plumbing touching a cache-shaped array (no conversion copies).
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import tiny_config, tiny_weights
from jaxserve.attention import backends, kv_layout, pallas_backend, reference
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.model import decoder
from jaxserve.model.layers import rope_inv_freq
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.shard import ShardingPlan
from kernels_pallas.ragged_paged_attention import kernel_tpu_pm as pm
from kernels_pallas.ragged_paged_attention.cases import make_case

ATOL = 1e-4     # float32 layer outputs |y| ~ 40 summed in another order than the reference


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


@pytest.mark.parametrize("tp", [1, 2])
def test_decoder_layer_on_page_major_cache_matches_reference(tp):
    cfg = tiny_config(head_dim=128)
    case, x, junk, md = _inputs(cfg)
    want = _layer(cfg, reference.paged_attention, x, junk, md)
    fused = functools.partial(pallas_backend.paged_attention_update_pm, interpret=True)
    kv = pm.to_page_major(*junk)
    if tp > 1:
        plan = ShardingPlan.build(cfg, make_mesh(tensor_parallel_size=tp), log_summary=False)
        fused = plan.shard_attention(fused, writes_kv=True, kv_layout=kv_layout.PAGE_MAJOR)
        kv = jax.device_put(kv, plan.kv_sharding(kv_layout.PAGE_MAJOR))
    out, got_kv, none = _layer(cfg, backends.KVWritingAttention(fused), x, (kv, None), md)
    assert none is None and got_kv.shape == kv.shape
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(want[0][:n]), atol=ATOL,
                               rtol=2e-5)
    for a, b in zip(pm.from_page_major(got_kv), want[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(want[1]), np.asarray(junk[0]))
    assert backends.writes_kv(pallas_backend.make_attn_fn("tpu", tpu_kernel="pm"))
    assert backends.writes_kv(pallas_backend.make_attn_fn("cpu", tpu_kernel="pm"))
    assert not backends.writes_kv(pallas_backend.make_attn_fn("cpu"))


@pytest.mark.parametrize("tp,heads", [(8, 1), (4, 2)])
def test_page_major_cache_sharding_keeps_each_chips_heads(tp, heads):
    from jaxserve.tools.export_check import model_config
    cfg = model_config("llama3-8b")
    plan = ShardingPlan.build(cfg, make_mesh(tensor_parallel_size=tp), log_summary=False)
    assert plan.kv_heads_per_device == heads
    kv = plan.init_kv_cache(3, 16, jnp.bfloat16, "int8", kv_layout.PAGE_MAJOR)
    assert len(kv) == cfg.num_layers and all(v is None for _, v in kv)
    values, scales = kv[0][0].values, kv[0][0].scales
    assert values.shape == (3, 16, 16, 128) and scales.shape == (3, 16, 16)
    for leaf in (values, scales):
        shards = sorted(leaf.addressable_shards, key=lambda s: s.index[1].start)
        assert [s.data.shape[1] for s in shards] == [2 * heads] * tp
        # device d holds rows [2 * heads * d, 2 * heads * (d + 1)): heads d*heads.., K and V
        assert [s.index[1].start for s in shards] == [2 * heads * d for d in range(tp)]
        assert all(s.data.shape[0] == 3 for s in shards)


def _exported_step(tp):
    from jaxserve.tools import export_check as mod
    mod.pretend_tpu("v5e")
    ns = mod.parse_args(["--platform", "tpu", "--shape", "llama3-8b", "--tp", str(tp),
                         "--num-blocks", str(NB), "--tpu-kernel", "pm"])
    target = mod.Target(ns)
    assert target.layout == kv_layout.PAGE_MAJOR
    t, p = mod.pick_buckets(target.buckets.all_shapes(), 1)[0]
    return mod, target, target.export(t, p)["step"]


NB = 72             # a block count no other array of the step has
# ops allowed to touch a cache-shaped array: the kernel call (its cache alias), shard_map,
# calls, returns, sharding annotations
CACHE_OPS_OK = {"stablehlo.custom_call", "stablehlo.output_operand_alias",
                "sdy.manual_computation", "sdy.return", "sdy.sharding", "func.call",
                "func.func", "func.return", "return"}


@pytest.mark.parametrize("tp", [8, 4])
def test_exported_llama3_step_runs_the_pm_kernel_on_the_native_cache(tp):
    mod, target, mlir = _exported_step(tp)
    assert mod.count_kernel_calls(mlir, mod.KERNEL_TARGETS["tpu"]) == 32
    assert "ragged_paged_attention_tpu_pm" in mlir
    assert "ragged_paged_attention_tpu_v3" not in mlir
    bs, H, K = target.bs, 128, 8
    local = 2 * K // tp
    cache = re.compile(rf"tensor<(?:{NB}x\d+x{bs}x{H}|\d+x{NB}x{bs}x{H})x")
    touching = set()
    for line in mlir.splitlines():
        if cache.search(line):
            touching.update(re.findall(r"\b(?:stablehlo|sdy|func)\.[a-z_]+", line))
    assert touching and touching <= CACHE_OPS_OK, touching - CACHE_OPS_OK
    # no conversion: no head-major cache shape anywhere, the kernel sees its chip's rows
    assert not re.search(rf"tensor<\d+x{NB}x{bs}x{H}x", mlir)
    assert f"tensor<{NB}x{local}x{bs}x{H}xbf16>" in mlir
    assert not re.search(r"stablehlo\.scatter.{0,200}update_window_dims = \[0, 2\], "
                         r"inserted_window_dims = \[1\]", mlir)
