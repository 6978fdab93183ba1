"""Mixture-of-experts models on 8 simulated CPU devices: expert parallelism (EP) and
tensor parallelism inside the experts, against one device.

EP (--enable-expert-parallel) splits the experts whole over the TP devices while
attention stays tensor-parallel; without it each expert's hidden size is split. For
each tiny checkpoint (tests/support/moe_utils.py) and layout: the expert weights sit 1/N per
device and full-sequence logits equal one device's (1e-5); for each distinct set of
plan decisions, the engine's greedy tokens equal one device's with no recompiles after
warm-up.
"""
from __future__ import annotations

import pytest

import jax
import numpy as np

from engine_utils import core_greedy, random_prompts
from jaxserve.config import EngineArgs
from jaxserve.core.engine_core import EngineCore
from jaxserve.model.loader.load import load_model
from jaxserve.parallel import ShardingPlan, make_mesh, per_device_bytes
from jaxserve.parallel.rules import ShardingRules
from model_utils import Generator
from moe_utils import save_moe_model


SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=24,
             token_buckets=[8, 24], num_kv_blocks=48)
MAX_TOKENS = 12
# (variant, tp, expert parallel): E=6 / 12 / 8 experts; EP=N puts E/N on each device.
# qwen3 EP=2 is EP with TP: its 6 query / 2 KV heads are split over the same 2 devices.
LAYOUTS = [("mixtral_e6_top2_window", 2, True), ("mixtral_e6_top2_window", 2, False),
           ("qwen3_moe_e12_top3_dense_layer", 2, True),
           ("qwen3_moe_e12_top3_dense_layer", 4, True),
           ("olmoe_e8_top2_clip", 4, True), ("olmoe_e8_top2_clip", 8, True),
           ("olmoe_e8_top2_clip", 4, False)]
# The engine runs one layout per distinct plan (what the plan splits, at which TP):
#   mixtral 2 EP      experts 3 per device, attention and its one KV head whole
#   mixtral 2 no EP   each expert's F split (moe_ffn), the experts whole
#   qwen3 2 EP        EP with attention split too (query and KV heads), a dense layer
#   qwen3 4 EP        EP over 4 devices, attention whole, the dense layer's F split
#   olmoe 8 EP        one expert per device over all 8, q/k norms and clip_qkv
# olmoe 4 EP splits what qwen3 4 EP splits (experts, ffn, vocab at TP=4) and olmoe 4
# without EP what mixtral 2 without EP splits (ffn, moe_ffn, vocab): their weights and
# logits are checked above, their engines would repeat a kept layout's sharded step.
ENGINE_LAYOUTS = [layout for layout in LAYOUTS
                  if layout not in {("olmoe_e8_top2_clip", 4, True),
                                    ("olmoe_e8_top2_clip", 4, False)}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in sorted({v for v, _, _ in LAYOUTS}):
        path = tmp_path_factory.mktemp(name)
        save_moe_model(name, path)
        lm = load_model(str(path), progress=False)
        out[name] = (lm.config, jax.tree_util.tree_map(np.asarray, lm.weights))
    return out


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 128, 4, 50, seed=11)


def run_greedy(engine, prompts) -> list[list[int]]:
    return core_greedy(engine, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def references(models, prompts):
    # the one-device engines compile only the shapes their steps use: their compiles
    # are not counted
    return {name: run_greedy(EngineCore(EngineArgs(**SMALL), cfg, w, progress=False,
                                        warmup=False), prompts)
            for name, (cfg, w) in models.items()}


def _plan(cfg, tp: int, ep: bool) -> ShardingPlan:
    rules = ShardingRules.load()
    return ShardingPlan.build(cfg, make_mesh(tp), rules.expert_parallel() if ep else rules)


@pytest.mark.parametrize("variant,tp,ep", LAYOUTS)
def test_expert_weights_split_and_logits_equal(models, prompts, variant, tp, ep):
    cfg, w = models[variant]
    plan = _plan(cfg, tp, ep)
    part = plan.runtime_cfg.moe_partition
    assert part is not None
    assert (part.expert_axes, part.ffn_axes) == ((("model",), ()) if ep else ((), ("model",)))
    moe_layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    placed = plan.shard_weights(w)
    for key in ("w_gate_e", "w_up_e", "w_down_e"):
        arr = placed["layers"][moe_layer][key]
        per_dev = per_device_bytes(arr)
        assert len(per_dev) == tp and set(per_dev.values()) == {arr.nbytes // tp}
    ref = Generator(w, cfg).logits(prompts)
    got = Generator(placed, plan.runtime_cfg).logits(prompts)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.warmup
@pytest.mark.parametrize("variant,tp,ep", ENGINE_LAYOUTS)
def test_engine_greedy_equals_one_device(models, prompts, references, variant, tp, ep):
    cfg, w = models[variant]
    engine = EngineCore(EngineArgs(**SMALL, tensor_parallel_size=tp,
                                   enable_expert_parallel=ep), cfg, w, progress=False)
    part = engine.runner.cfg.moe_partition
    assert part is not None and bool(part.expert_axes) == ep
    compiles = engine.num_compiles
    assert run_greedy(engine, prompts) == references[variant]
    assert engine.num_compiles == compiles
