"""Gemma 2 / Gemma 3 GGUF files as llama.cpp writes them (tests/support/gemma_gguf.py
follows its converter) load in jaxserve and match transformers reading the same file.

transformers' GGUF reader takes only some Gemma keys (not the soft-caps, the sliding
pattern, the local RoPE base, rope scaling or query_pre_attn_scalar: it uses its config
defaults), so the models here keep those at the defaults llama.cpp and transformers
share: head_dim 256 = query_pre_attn_scalar (llama.cpp scales by head_dim), Gemma 2
soft-caps 50 / 30, Gemma 3 six layers (five sliding, one full), bases 10^6 / 10^4.
jaxserve reads what llama.cpp reads from the file, and the safetensors checkpoint of the
same model must give the same logits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from gemma_gguf import write_gemma_gguf
from jaxserve.model.loader.load import load_model
from jaxserve.model.loader.gguf_file import read_gguf
from model_utils import Generator, hf_greedy, hf_logits, tiny_tokenizer
from test_model_gemma import TEXTS, make_gemma

N_VOCAB = len(tiny_tokenizer().get_vocab())          # 103: no embedding rows cut
SHAPES = dict(vocab_size=N_VOCAB, hidden_size=48, intermediate_size=64, num_attention_heads=3,
              num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=5)
GGUF_MODELS = {
    "gemma2": dict(SHAPES, num_hidden_layers=3, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, layer_types=None),
    "gemma3": dict(SHAPES, num_hidden_layers=6, layer_types=None, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10_000.0}}),
}


@pytest.fixture(scope="module", params=sorted(GGUF_MODELS))
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}-gguf")
    model = make_gemma(request.param, seed=4, **GGUF_MODELS[request.param])
    tok = tiny_tokenizer()
    model.save_pretrained(str(path / "hf"), safe_serialization=True)
    tok.save_pretrained(str(path / "hf"))
    gguf_path = path / "model-f32.gguf"
    write_gemma_gguf(gguf_path, model, tok)
    prompts = [tok(t).input_ids for t in TEXTS]
    return request.param, path, gguf_path, model, prompts


def test_gguf_config_is_what_llama_cpp_reads(written):
    variant, path, gguf_path, model, _ = written
    cfg, _ = read_gguf(gguf_path)
    st = load_model(str(path / "hf"), progress=False, skip_tokenizer=True).config
    assert cfg.layer_types == st.layer_types == tuple(model.config.layer_types)
    assert cfg.family == st.family and cfg.architecture == st.architecture
    same = ("head_dim", "num_heads", "num_kv_heads", "sliding_window", "rope_theta",
            "rope_local_theta", "attn_logit_softcap", "final_logit_softcap",
            "query_pre_attn_scalar", "norm_offset", "qk_norm", "tie_word_embeddings")
    assert {k: getattr(cfg, k) for k in same} == {k: getattr(st, k) for k in same}


def transformers_from_gguf(gguf_path) -> transformers.PreTrainedModel:
    """transformers' own GGUF reading (config, dequantized tensors, its Gemma norm - 1);
    from_pretrained(gguf_file=...) does the same but wants `accelerate`, not installed."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.for_model(**load_gguf_checkpoint(str(gguf_path))["config"])
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True,
                                   model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model


def test_gguf_matches_transformers_reading_the_same_file(written):
    variant, path, gguf_path, model, prompts = written
    hf = transformers_from_gguf(gguf_path)
    assert hf.config.model_type == model.config.model_type
    cfg, weights = read_gguf(gguf_path)
    gen = Generator(weights, cfg, extra=16)
    st = load_model(str(path / "hf"), progress=False, skip_tokenizer=True)
    from_st = Generator(st.weights, st.config, extra=16).logits(prompts)
    for ids, got, ref in zip(prompts, gen.logits(prompts), from_st):
        assert np.abs(got - hf_logits(hf, ids)).max() < 1e-4, variant
        assert np.abs(got - ref).max() < 1e-5, variant
    assert gen.greedy(prompts, 16) == [hf_greedy(hf, ids, 16) for ids in prompts]


def test_gguf_norms_are_stored_plus_one(written):
    """The file holds 1 + w (llama.cpp's convention); the loader gives back w."""
    _, _, gguf_path, model, _ = written
    from gguf import GGUFReader
    stored = {t.name: np.asarray(t.data) for t in GGUFReader(str(gguf_path)).tensors}
    hf_w = model.model.layers[0].post_attention_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(stored["blk.0.post_attention_norm.weight"], hf_w + 1, atol=1e-7)
    _, weights = read_gguf(gguf_path)
    np.testing.assert_allclose(np.asarray(weights["layers"][0]["post_attn_norm"]), hf_w, atol=1e-6)
