"""Mixture-of-experts models against transformers: Mixtral, Qwen3-MoE, OLMoE.

Tiny random checkpoints written by transformers (tests/support/moe_utils.py), read by jaxserve's
loader. float32: full-sequence logits within 1e-4 of transformers, and greedy tokens
identical through the engine (paged KV cache, chunked prefill, many requests per step,
no recompiles after warm-up). bfloat16: the engine's first 16 greedy tokens equal
transformers' float32 ones on most prompts (counts printed, also against transformers'
own bfloat16 run). Units: the routers against transformers' router modules, the grouped
matmul (both forms) against numpy, and the split of the experts over devices against
the whole. Sharded runs (EP, TP): tests/multidevice/test_moe_devices.py.
"""
from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from engine_utils import random_prompts
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM
from jaxserve.model import moe
from jaxserve.model.config import ModelConfig
from jaxserve.model.loader.load import load_model
from model_utils import Generator, hf_greedy, hf_logits
from moe_utils import BF16_INIT_RANGE, MOE_VARIANTS, save_moe_model

LOGITS_ATOL = 1e-4
N_TOKENS = 16
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=24,
              token_buckets=[8, 24], block_size=16, num_kv_blocks=48)


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_moe_model(request.param, path)


@pytest.fixture(scope="module")
def prompts():
    # lengths up to 60 > the 24-token budget (chunked) and > Mixtral's window of 12
    return random_prompts(6, 128, 4, 60, seed=7)


def _engine_greedy(path, prompts, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), **{**ENGINE, **kw})
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_config_switches(saved):
    name, path, model = saved
    lm = load_model(str(path), progress=False)
    c = lm.config
    hf = model.config
    assert c.num_experts == (hf.num_local_experts if name.startswith("mixtral")
                             else hf.num_experts)
    assert c.num_experts_per_tok == hf.num_experts_per_tok
    layer_kinds = ["router" in layer for layer in lm.weights["layers"]]
    if name.startswith("qwen3"):
        assert layer_kinds == [True, False, True] and c.qk_norm and c.norm_topk_prob
        assert lm.weights["layers"][1]["w_gate"].shape == (48, 56)
    else:
        assert all(layer_kinds)
    if name.startswith("olmoe"):
        assert c.qk_norm_full and c.clip_qkv == 3.0 and not c.norm_topk_prob
        assert lm.weights["layers"][0]["q_norm"].shape == (48,)
    if name.startswith("mixtral"):
        assert c.moe_router == "mixtral" and c.sliding_window == 12
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_logits_match_transformers_fp32(saved, prompts):
    name, path, model = saved
    lm = load_model(str(path), progress=False)
    gen = Generator(lm.weights, lm.config)
    for ids, got in zip(prompts, gen.logits(prompts)):
        diff = np.abs(got - hf_logits(model, ids)).max()
        assert diff < LOGITS_ATOL, f"{name}: max |logit diff| {diff:.2e}"


@pytest.mark.warmup
def test_engine_greedy_matches_transformers_fp32(saved, prompts):
    name, path, model = saved
    llm = LLM(str(path), dtype="float32", **ENGINE)
    warm = llm.num_compiles      # every bucket was compiled at start-up
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == [hf_greedy(model, p, N_TOKENS) for p in prompts], name
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(9, 128, 1, 70, seed=9)],
                 params, use_tqdm=False)
    assert llm.num_compiles == warm, "an MoE step compiled after warm-up"


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_engine_bfloat16_first_16_tokens_mostly_match(variant, tmp_path):
    """The engine in bfloat16 against the float32 reference (transformers), 8 prompts:
    most identical for 16 tokens, and about as often as transformers' own bfloat16 run
    (which rounds more: it multiplies norm weights in bf16). Counts are printed; models
    at moe_utils.BF16_INIT_RANGE."""
    model = save_moe_model(variant, tmp_path, init_range=BF16_INIT_RANGE)
    prompts = random_prompts(8, 128, 4, 60, seed=3)
    got, _ = _engine_greedy(tmp_path, prompts, dtype="bfloat16")
    hf32 = [hf_greedy(model, p, N_TOKENS) for p in prompts]
    ref_model = copy.deepcopy(model).to(torch.bfloat16)
    want = [hf_greedy(ref_model, p, N_TOKENS) for p in prompts]
    same = lambda a, b: sum(x == y for x, y in zip(a, b))   # noqa: E731
    print(f"{variant} bfloat16, first {N_TOKENS} tokens identical: engine vs transformers "
          f"bf16 {same(got, want)}/8, engine bf16 vs transformers fp32 {same(got, hf32)}/8, "
          f"transformers bf16 vs fp32 {same(want, hf32)}/8")
    assert same(got, hf32) >= 6, f"{variant}: only {same(got, hf32)}/8 identical"
    assert same(got, hf32) >= same(want, hf32) - 1


def test_fused_step_matches_transformers(tmp_path):
    """The fused step (one jitted program for all layers) on the model that mixes MoE and
    dense layers; the other tests run the default (layerwise) step."""
    model = save_moe_model("qwen3_moe_e12_top3_dense_layer", tmp_path)
    prompts = random_prompts(3, 128, 4, 60, seed=5)
    got, _ = _engine_greedy(tmp_path, prompts, dtype="float32", step_mode="fused")
    assert got == [hf_greedy(model, p, N_TOKENS) for p in prompts]


# ---- units ---------------------------------------------------------------------------

def _hf_router(family: str, E: int, k: int, D: int, norm: bool):
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
        cfg = transformers.MixtralConfig(hidden_size=D, num_local_experts=E,
                                         num_experts_per_tok=k)
        return MixtralTopKRouter(cfg)
    if family == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
        cfg = transformers.OlmoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=k,
                                       norm_topk_prob=norm)
        return OlmoeTopKRouter(cfg)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    cfg = transformers.Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=k,
                                      norm_topk_prob=norm)
    return Qwen3MoeTopKRouter(cfg)


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True),
                                         ("qwen3_moe", False), ("olmoe", False)])
def test_router_matches_transformers(family, norm):
    E, k, D, T = 7, 3, 16, 20
    router = _hf_router(family, E, k, D, norm)
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.5, (E, D)).astype(np.float32)
    x = rng.normal(0, 1, (T, D)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        _, want_w, want_ids = router(torch.from_numpy(x))
    cfg = ModelConfig("x", family, 8, D, 8, 1, 1, 1, 8, num_experts=E, num_experts_per_tok=k,
                      norm_topk_prob=norm,
                      moe_router="mixtral" if family == "mixtral" else "softmax_topk")
    ids, weights = moe.route(jnp.asarray(x), jnp.asarray(w.T), cfg)
    np.testing.assert_array_equal(np.asarray(ids), want_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), want_w.numpy(), rtol=1e-6, atol=1e-7)
    if norm:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


def _np_grouped(xs, wg, wu, wd, sizes):
    out = np.zeros((xs.shape[0], wd.shape[2]), np.float64)
    s = 0
    for g, n in enumerate(sizes):
        x = xs[s:s + n].astype(np.float64)
        h = x @ wg[g]
        out[s:s + n] = (h / (1 + np.exp(-h)) * (x @ wu[g])) @ wd[g]
        s += n
    return out, s


@pytest.mark.parametrize("rows,sizes", [(2, [0, 1, 0, 1]), (16, [5, 0, 0, 11]),
                                        (200, [70, 0, 33, 90]), (40, [3, 0, 9, 1])])
def test_grouped_matmul_forms_match_numpy(rows, sizes):
    """Both forms of the grouped matmul against a per-group numpy loop; sizes with empty
    experts and (last case) rows past the groups, as EP leaves them."""
    rng = np.random.default_rng(rows)
    G, D, F = len(sizes), 12, 20
    xs = rng.normal(0, 1, (rows, D)).astype(np.float32)
    wg, wu = (rng.normal(0, 0.3, (G, D, F)).astype(np.float32) for _ in range(2))
    wd = rng.normal(0, 0.3, (G, F, D)).astype(np.float32)
    want, used = _np_grouped(xs, wg, wu, wd, sizes)
    args = [jnp.asarray(a) for a in (xs, wg, wu, wd)] + [jnp.asarray(sizes, jnp.int32)]
    for fn in (moe._grouped_mlp_chunks, moe.grouped_mlp_ragged, moe.grouped_mlp):
        got = np.asarray(jax.jit(fn)(*args))
        np.testing.assert_allclose(got[:used], want[:used], rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(jax.jit(moe._grouped_mlp_chunks)(*args))[used:] == 0)


def test_experts_split_in_two_sum_to_the_whole():
    """What each EP rank computes: its experts' share; the shares add up to the whole."""
    rng = np.random.default_rng(1)
    T, k, E, D, F = 9, 3, 6, 8, 10
    x = jnp.asarray(rng.normal(0, 1, (T, D)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1, (T, k)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(0, 0.3, (E, D, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(0, 0.3, (E, F, D)), jnp.float32)
    # jitted, as a step runs it (the first expert traced, as a rank's offset is)
    expert_outputs = jax.jit(moe.expert_outputs)
    whole = expert_outputs(x, ids, w, wg, wu, wd, 0)
    halves = sum(expert_outputs(x, ids, w, wg[s:s + 3], wu[s:s + 3], wd[s:s + 3], s)
                 for s in (0, 3))
    np.testing.assert_allclose(np.asarray(halves), np.asarray(whole), rtol=1e-5, atol=1e-6)
    # and the whole against a dense per-token reference
    xs, idn, wn = np.asarray(x, np.float64), np.asarray(ids), np.asarray(w, np.float64)
    ref = np.zeros((T, D))
    for t in range(T):
        for j in range(k):
            e = idn[t, j]
            h = xs[t] @ np.asarray(wg[e])
            ref[t] += wn[t, j] * ((h / (1 + np.exp(-h)) * (xs[t] @ np.asarray(wu[e])))
                                  @ np.asarray(wd[e]))
    np.testing.assert_allclose(np.asarray(whole), ref, rtol=1e-5, atol=1e-5)


def test_cpu_lowering_has_no_dense_expert_product():
    """On CPU the MoE lowers to the chunk loop (a while loop), not to jax's dense
    ragged_dot expansion ([E, rows, D] operand); for TPU it lowers to ragged_dot."""
    T, k, E, D, F = 64, 2, 8, 16, 32
    x = jax.ShapeDtypeStruct((T * k, D), jnp.float32)
    wg = jax.ShapeDtypeStruct((E, D, F), jnp.float32)
    wd = jax.ShapeDtypeStruct((E, F, D), jnp.float32)
    sizes = jax.ShapeDtypeStruct((E,), jnp.int32)
    cpu = jax.jit(moe.grouped_mlp).lower(x, wg, wg, wd, sizes).as_text()
    assert "while" in cpu and f"{E}x{T * k}x{D}" not in cpu
    tpu = jax.export.export(jax.jit(moe.grouped_mlp), platforms=["tpu"])(
        x, wg, wg, wd, sizes).mlir_module()
    assert "ragged_dot" in tpu
