"""Gemma 2 and Gemma 3 (text) against transformers, through the real loaders and engine.

Tiny random checkpoints with awkward shapes: 3 or 5 query heads over 1 KV head, head_dim
(32 / 24) != hidden / heads (16 / 12), sliding windows (5 / 6) far shorter than the
prompts (19-36 tokens), sliding and full layers mixed (Gemma 2 alternating; Gemma 3 with
its own layer_types, local RoPE base 10^4 vs global 10^6 with linear scaling x2), Gemma 2's
attention and final soft-caps small enough to bite, query_pre_attn_scalar != head_dim.
Saved with save_pretrained, loaded by jaxserve's loader, compared with transformers
(eager attention) in float32:

* full-sequence logits within 1e-4 (paged KV cache, one ragged prefill step);
* through the engine with chunked prefill (a 16-token budget: prompts take 2-3 steps),
  both step forms and both CPU attention backends: prompt logprobs within 1e-4 of
  transformers' log-softmax and 24 greedy tokens identical to transformers' own KV-cached
  decoding;
* bfloat16 weights: the first 16 greedy tokens equal float32's (transformers') on at least
  4 of 5 prompts (the count is printed);
* a Gemma3ForConditionalGeneration checkpoint: its language model loads (the vision tower
  is skipped) and gives the multimodal model's logits on text.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM
from jaxserve.model.export import to_transformers
from jaxserve.model.loader.load import load_model
from model_utils import TINY, Generator, hf_greedy, hf_logits, tiny_tokenizer

ATOL = 1e-4
TEXTS = ["Hello there, how are you doing today?", "The quick brown fox jumps over",
         "1+1=2; 2+2=4; 3+3=", "Sliding windows: short, and shorter still.",
         "abcdefghijklmnopqrstuvwxyz0123456789"]
CHUNKED = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16,
               token_buckets=[16], num_kv_blocks=48)
GEMMA = {
    "gemma2": ("Gemma2Config", dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=32, sliding_window=5, query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(
        hidden_size=60, intermediate_size=80, num_hidden_layers=4, num_attention_heads=5,
        num_key_value_heads=1, head_dim=24, sliding_window=6, query_pre_attn_scalar=30,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"], tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}


def make_gemma(variant: str, seed: int = 0, **over) -> transformers.PreTrainedModel:
    cls_name, kw = GEMMA[variant]
    cfg = getattr(transformers, cls_name)(**{**TINY, **kw, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # Gemma norms start at 0 (scale 1 + w): make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model


def save_gemma(variant: str, path, **over) -> transformers.PreTrainedModel:
    model = make_gemma(variant, **over)
    model.save_pretrained(str(path), safe_serialization=True)
    tiny_tokenizer().save_pretrained(str(path))
    return model


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    return torch.log_softmax(torch.tensor(hf_logits(model, ids)).double(), -1).numpy()


@pytest.fixture(scope="module", params=sorted(GEMMA))
def gemma(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_gemma(request.param, path)
    lm = load_model(str(path), progress=False)
    prompts = [lm.tokenizer(t).input_ids for t in TEXTS]
    return request.param, path, model, lm, prompts


@pytest.fixture(scope="module")
def hf_ref(gemma):
    """transformers' float32 references on the prompts, computed once per model for the
    tests that read them: (24 greedy tokens, prompt log-probabilities) of each prompt."""
    _, _, model, _, prompts = gemma
    return [(hf_greedy(model, p, 24), hf_logprobs(model, p)) for p in prompts]


def test_config_switches(gemma):
    variant, _, model, lm, _ = gemma
    cfg, hf = lm.config, model.config
    assert cfg.layer_types == tuple(hf.layer_types) and len(set(cfg.layer_types)) == 2
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (hf.head_dim, hf.num_attention_heads,
                                                                hf.num_key_value_heads)
    assert cfg.head_dim * cfg.num_heads != cfg.hidden_size
    assert cfg.sliding_window == hf.sliding_window < min(map(len, gemma[4]))
    assert cfg.norm_offset == 1.0 and cfg.sandwich_norms and cfg.embed_scale
    assert cfg.hidden_act == "gelu_tanh" and cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
    # to_hf_dict (orbax's config.json, export to transformers) reads back the same
    assert type(cfg).from_hf_dict(cfg.to_hf_dict()) == cfg
    if variant == "gemma2":
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (4.0, 6.0)
        assert not cfg.qk_norm and cfg.rope_local_theta is None
    else:
        assert cfg.qk_norm and cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_type) == (1e6, 1e4, "linear")


def test_logits_match_transformers(gemma):
    variant, _, model, lm, prompts = gemma
    for ids, got in zip(prompts, Generator(lm.weights, lm.config).logits(prompts)):
        diff = np.abs(got - hf_logits(model, ids)).max()
        assert diff < ATOL, f"{variant}: max |logit diff| {diff:.2e}"
    # and back: our config and weights export to the same transformers model
    exported = to_transformers(lm.config, lm.weights)
    exported.config._attn_implementation = "eager"
    assert np.abs(hf_logits(exported, prompts[0]) - hf_logits(model, prompts[0])).max() < 1e-6


@pytest.mark.warmup
@pytest.mark.parametrize("backend,step_mode", [("cpu", "layerwise"), ("reference", "fused")])
def test_engine_chunked_prefill_matches_transformers(gemma, hf_ref, backend, step_mode):
    variant, _, model, lm, prompts = gemma
    llm = LLM.from_weights(lm.config, lm.weights, lm.tokenizer, attention_backend=backend,
                           step_mode=step_mode, **CHUNKED)
    warm = llm.num_compiles
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.num_compiles == warm, "recompiled after warm-up"
    for p, o, (greedy, ref) in zip(prompts, outs, hf_ref):
        worst = max(abs(lp.logprob - ref[i - 1][t]) for i in range(1, len(p))
                    for t, lp in o.prompt_logprobs[i].items())
        assert worst < ATOL, f"{variant} {backend}: prompt logprob off by {worst:.2e}"
        assert o.outputs[0].token_ids == greedy, (variant, backend, p)


def test_bfloat16_mostly_agrees_with_float32(gemma, hf_ref):
    """Against float32's greedy tokens as transformers gives them (the engine's equal
    them: the test above), so no float32 program of our own is compiled for it."""
    variant, path, _, lm, prompts = gemma
    f32 = [greedy[:16] for greedy, _ in hf_ref]
    bf = load_model(str(path), dtype="bfloat16", progress=False)
    assert bf.weights["embed"].dtype == np.dtype("bfloat16")
    got = Generator(bf.weights, bf.config, extra=16).greedy(prompts, 16)
    same = sum(a == b for a, b in zip(got, f32))
    print(f"{variant} bfloat16 vs float32: {same}/{len(prompts)} prompts identical for 16 tokens")
    assert same >= len(prompts) - 1


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration: the language model is loaded (vision tower and
    projector skipped) and gives the multimodal model's logits on text."""
    _, text = GEMMA["gemma3"]
    cfg = transformers.Gemma3Config(
        text_config={**TINY, **text}, mm_tokens_per_image=4, image_token_index=127,
        boi_token_index=125, eoi_token_index=126,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14))
    cfg.text_config._attn_implementation = "eager"
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    tiny_tokenizer().save_pretrained(str(tmp_path))
    lm = load_model(str(tmp_path), progress=False)
    assert lm.config.architecture == "Gemma3ForCausalLM" and lm.config.layer_types
    prompts = [lm.tokenizer(t).input_ids for t in TEXTS[:2]]
    for ids, got in zip(prompts, Generator(lm.weights, lm.config).logits(prompts)):
        assert np.abs(got - hf_logits(model, ids)).max() < ATOL
