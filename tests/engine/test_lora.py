"""LoRA adapters in the engine: greedy tokens equal transformers + peft for the base model
and several adapters mixed in one batch (the hybrid step: fused for the 8-token bucket,
layerwise for the 32-token one; chunked prefill), and transformers with the adapter
merged into its weights elsewhere;
no recompiles while adapters rotate through fewer slots; no prefix-cache block shared
between adapters or with the base model; n > 1 and preemption; n-gram speculation;
int8 and GGUF Q8_0 base weights (a Qwen3 checkpoint and the default model against peft,
with logprobs: test_lora_peft.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine_pool import tiny_model
from engine_utils import hf_greedy, hf_model_from_weights, random_prompts
from lora_utils import merge_into, peft_greedy, peft_model, save_adapter
from jaxserve.core.sched.output import StepKind
from jaxserve.frontend.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.sampling.params import SamplingParams

# the rotation test counts compiles after warm-up: the module's engines warm up at start
pytestmark = pytest.mark.warmup

N = 6
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
# bucket 8: the fused step (and multi-step decode), bucket 32: the layerwise step; a
# 32-token budget splits the longer prompts (chunked prefill); 10 KV blocks of 16
# tokens make a batch of 8 requests crossing a block preempt
ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
            max_model_len=128, max_num_seqs=8, token_buckets=[8, 32],
            max_num_batched_tokens=32, num_kv_blocks=10)
# (rank, targets, rsLoRA) of the adapters: different ranks and target sets
SPECS = [(4, ("q_proj", "v_proj"), False),
         (8, ("k_proj", "o_proj", "gate_proj", "down_proj"), True),
         (2, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
         (8, ("up_proj",), False), (3, ("o_proj", "v_proj"), False), (5, ("q_proj",), True)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg, w, tok = tiny_model()
    root = tmp_path_factory.mktemp("adapters")
    paths = [save_adapter(root / f"a{i}", cfg, rank=r, seed=10 + i, targets=t, rslora=rs)
             for i, (r, t, rs) in enumerate(SPECS)]
    llm = LLM.from_weights(cfg, w, tok, **ARGS)
    return cfg, w, llm, paths


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 128, 5, 20, seed=3) + random_prompts(1, 128, 40, 40, seed=4)


def _reference(cfg, w, path: Path | None, prompt: list[int]) -> list[int]:
    hf = hf_model_from_weights(cfg, w)
    return hf_greedy(merge_into(hf, path) if path is not None else hf, prompt, N)


def _run(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _req(paths, i):
    return LoRARequest(f"a{i}", i + 1, str(paths[i]))


def test_mixed_batch_matches_peft(setup, prompts, monkeypatch):
    """Base + three adapters in one generate (two slots: the third adapter's request waits
    for a slot), each request equal to transformers + peft with its own adapter active."""
    cfg, w, llm, paths = setup
    kinds = []
    dispatch = llm.engine.runner.dispatch
    monkeypatch.setattr(llm.engine.runner, "dispatch",
                        lambda so: (kinds.append(so.kind), dispatch(so))[1])
    which = [None, 0, 1, 2, 1]          # the 40-token prompt runs adapter 1 in chunks
    got, _ = _run(llm, prompts, [None if i is None else _req(paths, i) for i in which])
    assert StepKind.MULTI_STEP_DECODE in kinds and StepKind.MIXED in kinds
    ref = peft_model(hf_model_from_weights(cfg, w), {f"a{i}": paths[i] for i in range(3)})
    want = [peft_greedy(ref, p, N, None if i is None else f"a{i}")[0]
            for i, p in zip(which, prompts)]
    assert got == want
    # the adapters change the outputs (the comparison is not vacuous)
    assert got[1] != peft_greedy(ref, prompts[1], N, None)[0]


def test_rotation_through_two_slots_compiles_nothing(setup, prompts):
    """Six adapters (two at a time) in turn, twice: no compile, outputs stable."""
    cfg, w, llm, paths = setup
    before, loads = llm.num_compiles, llm.engine.runner.lora_slots.loads
    p = prompts[0]
    first = [_run(llm, [p, p], [_req(paths, i), None])[0][0] for i in range(N)]
    again = [_run(llm, [p], [_req(paths, i)])[0][0] for i in reversed(range(N))]
    assert llm.num_compiles == before
    assert llm.engine.runner.lora_slots.loads - loads >= 2 * N - 4   # two stay resident
    assert again[::-1] == first
    assert first[3] == _reference(cfg, w, paths[3], p)
    assert len(set(map(tuple, first))) > 1


def test_prefix_cache_isolated_between_adapters(setup):
    """The same prompt under base, adapter 0 and adapter 1: each gets its own output and
    no prefix hit from another; a repeat under the same adapter hits."""
    cfg, w, llm, paths = setup
    llm.reset_prefix_cache()
    prompt = random_prompts(1, 128, 36, 36, seed=9)[0]      # two full 16-token blocks
    runs = [None, _req(paths, 0), _req(paths, 1)]
    outs, cached = zip(*[_run(llm, [prompt], [r]) for r in runs])
    assert list(cached) == [[0], [0], [0]]
    assert [o[0] for o in outs] == [_reference(cfg, w, None if r is None else paths[i - 1],
                                               prompt) for i, r in enumerate(runs)]
    again, hits = _run(llm, [prompt], [_req(paths, 1)])
    assert again == outs[2] and hits[0] >= 32


def test_bad_requests(setup):
    cfg, w, llm, paths = setup
    with pytest.raises(ValueError, match="no such adapter directory"):
        llm.generate("w5 w6", GREEDY, lora_request=LoRARequest("x", 99, "/nonexistent"))
    big = save_adapter(paths[0].parent / "big", cfg, rank=16, seed=1)
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
        llm.generate("w5 w6", GREEDY, lora_request=LoRARequest("big", 98, str(big)))
    assert not llm.engine.has_unfinished_requests()


def test_n_samples_and_preemption_keep_each_adapter(setup):
    """n = 2 and requests preempted (10 blocks for 8 requests crossing a block) and
    resumed: every sample still equals its adapter's reference."""
    cfg, w, llm, paths = setup
    prompts = random_prompts(8, 128, 14, 14, seed=5)
    which = [None, 0, 1, 0, None, 1, 0, 1]
    loras = [None if i is None else _req(paths, i) for i in which]
    before = llm.engine.scheduler.num_preemptions
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    assert llm.engine.scheduler.num_preemptions > before
    for o, i, p in zip(outs, which, prompts):
        want = _reference(cfg, w, None if i is None else paths[i], p)
        assert [c.token_ids for c in o.outputs] == [want, want]


@pytest.mark.slow     # its own engine
def test_ngram_speculation_verifies_with_the_adapter(setup):
    """Proposals (n-gram, from the prompt) are verified by the step with the request's
    adapter: outputs equal the adapter's reference, and proposals were made (each
    prompt holds its own continuation: p + continuation + p)."""
    cfg, w, _, paths = setup
    llm = LLM.from_weights(cfg, w, tiny_model()[2], **{
        **ARGS, "num_kv_blocks": 32,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                               "prompt_lookup_max": 2, "prompt_lookup_min": 1}})
    which = [0, None]
    prompts = []
    for i, p in zip(which, random_prompts(2, 128, 6, 6, seed=7)):
        hf = hf_model_from_weights(cfg, w)
        prompts.append(p + hf_greedy(merge_into(hf, paths[i]) if i is not None else hf, p,
                                     8) + p)
    got, _ = _run(llm, prompts, [None if i is None else _req(paths, i) for i in which])
    assert got == [_reference(cfg, w, None if i is None else paths[i], p)
                   for i, p in zip(which, prompts)]
    assert llm.engine.scheduler.spec_stats.num_drafts > 0


@pytest.mark.slow     # its own engine
def test_int8_base_weights(setup):
    """int8 base weights (dequantized in the step) with an adapter: equal to transformers
    on the dequantized weights with the adapter merged."""
    import jax
    import numpy as np
    from jaxserve.model.params import quantize_weights
    from jaxserve.model.cpu.matmul import QPackedWeight
    from jaxserve.model.quant import QArray
    cfg, w, _, paths = setup
    qw = quantize_weights(cfg, w, "int8", embed=False)

    def dequantized(orig, q):
        if not isinstance(q, QArray):
            return orig
        return np.asarray(q.dequantize(np.float32)).T     # HF [out, in] -> [in, out]
    deq = jax.tree_util.tree_map(dequantized, w, qw, is_leaf=lambda x: isinstance(x, QArray))
    llm = LLM.from_weights(cfg, qw, tiny_model()[2], **ARGS)
    prompts = random_prompts(2, 128, 8, 12, seed=13)
    got, _ = _run(llm, prompts, [_req(paths, 1), None])
    assert got == [_reference(cfg, deq, paths[1], prompts[0]),
                   _reference(cfg, deq, None, prompts[1])]


@pytest.mark.slow     # its own engine
def test_gguf_quantized_base(tmp_path):
    """A Q8_0 GGUF base kept quantized (--quantization gguf) with an adapter: equal to
    transformers on the GGUF's dequantized weights with the adapter merged."""
    from gguf import GGMLQuantizationType
    from model_utils import make_hf_model, write_llama_gguf
    from jaxserve.model.loader.gguf_file import read_gguf
    from jaxserve.model.cpu.matmul import QPackedWeight
    from jaxserve.model.quant import QArray
    write_llama_gguf(tmp_path / "m.gguf", make_hf_model("llama_gqa"),
                     qtype=GGMLQuantizationType.Q8_0)
    cfg, deq = read_gguf(tmp_path / "m.gguf", progress=False)     # dequantized floats
    llm = LLM(str(tmp_path / "m.gguf"), quantization="gguf", skip_tokenizer_init=True,
              **{**ARGS, "num_kv_blocks": 32, "token_buckets": [16],
                 "max_num_batched_tokens": 16})
    layer0 = llm.engine.runner.weights["layers"][0]
    # kept quantized (on CPU packed into the quantized matmul kernel's panels)
    assert isinstance(layer0["wq"], (QArray, QPackedWeight))
    ad = save_adapter(tmp_path / "ad", cfg, rank=4, seed=5,
                      targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    prompts = random_prompts(2, 128, 7, 12, seed=23)
    got, _ = _run(llm, prompts, [LoRARequest("g", 1, str(ad)), None])
    assert got == [_reference(cfg, deq, ad, prompts[0]), _reference(cfg, deq, None, prompts[1])]
