"""The TPU step writes the KV cache inside the attention kernel (kernel_tpu_v3's fused
update) instead of a separate XLA scatter.

* A decoder layer whose attn_fn is the v3 kernel with the fused update (TPU interpreter,
  DMAs modelled) gives the same output and the same caches as the reference path
  (reference.write_kv, then the jnp reference attention), unsharded and under shard_map
  with the KV heads split over 2 devices.
* The engine's fused step exported for TPU (Mosaic lowering from this CPU, as
  jaxserve.tools.export_check does) has no KV-cache scatter left: the non-fused build of the
  same step has two per layer, the fused one none.
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


# reference.write_kv's scatter as XLA lowers it: [K, slots, H] rows set at flat slots
KV_SCATTER = re.compile(r"stablehlo\.scatter.{0,200}update_window_dims = \[0, 2\], "
                        r"inserted_window_dims = \[1\]")
SCATTER_OP = re.compile(r'"stablehlo\.scatter"\(')     # the op, not its #attribute


def _layer_inputs(cfg):
    """A ragged batch (prefill chunk after context, decodes, an empty row, padding
    tokens) whose new-token cache slots hold junk: only a real write fixes them."""
    K, H = cfg.num_kv_heads, cfg.head_dim
    case = make_case(np.random.default_rng(3), [5, 1, 1, 9], [11, 20, 0, 0],
                     num_tokens=24, num_rows=6, num_kv_heads=K,
                     group=cfg.num_heads // K, head_dim=H, block_size=8, pages=4,
                     num_blocks=24)
    slots = jnp.asarray(case.slot_mapping)
    NB, bs = case.k_cache.shape[1], case.k_cache.shape[2]
    junk = [c.reshape(K, NB * bs, H).at[:, slots].set(val, mode="drop").reshape(c.shape)
            for c, val in ((case.k_cache, 7.0), (case.v_cache, -3.0))]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((24, cfg.hidden_size)),
                    jnp.float32)
    return case, x, junk


def _run_layer(cfg, attn_fn, x, caches, md):
    layer = tiny_weights(cfg)["layers"][0]
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    fn = jax.jit(lambda x, k, v: decoder.decoder_layer(x, layer, k, v, md, cfg, inv_freq,
                                                       attn_fn))
    return fn(x, *caches)


def _fused_v3(**kw):
    return backends.KVWritingAttention(functools.partial(
        pallas_backend.paged_attention_update, interpret=True, **kw))

# The layer's outputs reach |y| ~ 40 after an o-projection summing 1024 products, and
# the kernel path sums in another order than the reference: float32 rounding alone
# differs by ~2e-5 on some CPUs (a 2-core Xeon: 2.3e-5 at |y| = 0.13). A real fault
# (a wrong head, slot or mask) is off by O(1).
ATOL = 1e-4


def _assert_same(case, got, want):
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got[0][:n]), np.asarray(want[0][:n]),
                               atol=ATOL, rtol=2e-5)
    for a, b in zip(got[1:], want[1:]):      # the caches: the same writes, bit for bit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decoder_layer_fused_update_matches_reference_path():
    cfg = tiny_config(head_dim=128)
    case, x, junk = _layer_inputs(cfg)
    md = AttentionMetadata(**case.metadata_fields())
    want = _run_layer(cfg, reference.paged_attention, x, junk, md)
    got = _run_layer(cfg, _fused_v3(), x, junk, md)
    _assert_same(case, got, want)
    # the junk really was overwritten (else the cache comparison proves nothing)
    assert not np.array_equal(np.asarray(want[1]), np.asarray(junk[0]))


def test_decoder_layer_fused_update_under_shard_map():
    """TP=2 with 2 KV heads: each device writes its own head's slice of the cache."""
    cfg = tiny_config(head_dim=128)
    plan = ShardingPlan.build(cfg, make_mesh(tensor_parallel_size=2), log_summary=False)
    assert plan.attention_partition().kv_sharded
    case, x, junk = _layer_inputs(cfg)
    md = AttentionMetadata(**case.metadata_fields())
    sharded = [jax.device_put(c, plan.kv_sharding()) for c in junk]
    want = _run_layer(cfg, reference.paged_attention, x, junk, md)
    attn = backends.KVWritingAttention(plan.shard_attention(
        functools.partial(pallas_backend.paged_attention_update, interpret=True),
        writes_kv=True))
    got = _run_layer(cfg, attn, x, sharded, md)
    _assert_same(case, got, want)


def test_which_builds_fuse_the_write():
    """TPU fuses, sharded or not (TP > K included: each rank writes its own copy);
    CUDA, the CPU interpreter and the other backends keep the decoder's scatter."""
    assert backends.writes_kv(pallas_backend.make_attn_fn("tpu"))
    for platform in ("cuda", "cpu"):
        assert not backends.writes_kv(pallas_backend.make_attn_fn(platform))
    assert not backends.get_attention_backend("reference").writes_kv
    cfg = tiny_config()                                    # 2 KV heads
    for tp in (2, 4):
        plan = ShardingPlan.build(cfg, make_mesh(tensor_parallel_size=tp),
                                  log_summary=False)
        assert plan.attention_partition().kv_sharded
        assert backends.writes_kv(pallas_backend.make_attn_fn("tpu", plan))


def test_fused_update_with_kv_heads_duplicated_per_rank():
    """TP=4 over 2 KV heads (8 query heads): the cache holds each KV head twice, one
    copy per rank, split over the 4 devices (1 head each, not 2 replicated); each
    rank's kernel writes its copy. Same output as the unsharded reference path, and
    both copies of head j equal the reference cache's head j, bit for bit."""
    cfg = tiny_config(head_dim=128, num_heads=8)
    plan = ShardingPlan.build(cfg, make_mesh(tensor_parallel_size=4), log_summary=False)
    assert plan.kv_head_replicas == 2 and plan.kv_heads_per_device == 1
    rcfg = plan.runtime_cfg
    case, x, junk = _layer_inputs(cfg)
    md = AttentionMetadata(**case.metadata_fields())
    want = _run_layer(cfg, reference.paged_attention, x, junk, md)
    dup = [jax.device_put(jnp.repeat(c, 2, axis=0), plan.kv_sharding()) for c in junk]
    assert dup[0].addressable_shards[0].data.shape[0] == 1
    attn = backends.KVWritingAttention(plan.shard_attention(
        functools.partial(pallas_backend.paged_attention_update, interpret=True),
        writes_kv=True))
    got = _run_layer(rcfg, attn, x, dup, md)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got[0][:n]), np.asarray(want[0][:n]),
                               atol=ATOL, rtol=2e-5)
    for a, b in zip(got[1:], want[1:]):
        for copy in range(2):
            np.testing.assert_array_equal(np.asarray(a)[copy::2], np.asarray(b))


def _export_check():
    from jaxserve.tools import export_check as mod
    mod.pretend_tpu("v5e")
    return mod


@pytest.mark.parametrize("shape,tp", [("smollm2", 1), ("llama3-8b", 8)])
def test_exported_tpu_step_has_no_kv_scatter(shape, tp, monkeypatch):
    mod = _export_check()
    ns = mod.parse_args(["--platform", "tpu", "--shape", shape, "--tp", str(tp),
                         "--num-blocks", "64"])
    layers = mod.SHAPES[shape]["num_layers"]
    counts = {}
    for fused in (True, False):
        if not fused:     # the same step built the pre-fusion way: scatter, then kernel
            monkeypatch.setattr(pallas_backend, "fuses_kv_write", lambda *a: False)
        target = mod.Target(ns)
        t, p = mod.pick_buckets(target.buckets.all_shapes(), 1)[0]
        mlir = target.export(t, p)["step"]
        assert mod.count_kernel_calls(mlir, mod.KERNEL_TARGETS["tpu"]) == layers
        counts[fused] = (len(KV_SCATTER.findall(mlir)), len(SCATTER_OP.findall(mlir)))
    assert counts[False][0] == 2 * layers          # K and V written per layer
    assert counts[True][0] == 0
    assert counts[False][1] - counts[True][1] == 2 * layers
