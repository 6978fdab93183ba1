"""Model parity against transformers (float32), via the real loaders.

Tiny random models: full-sequence logits within 1e-4 (observed ~1e-5) and 32 greedy
tokens identical, for every family switch. SmolLM2-135M-Instruct (the default model):
32 greedy tokens identical to transformers running weights that transformers itself
dequantized from the same GGUF (its own un-permutation), on 5 prompts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.initialization import no_init_weights

from jaxserve.model.loader.default_model import default_gguf_path
from jaxserve.model.loader.load import load_model
from jaxserve.model.loader.gguf_file import read_gguf
from model_utils import VARIANTS, Generator, hf_greedy, hf_logits, save_hf_model

LOGITS_ATOL = 1e-4
TEXTS = ["Hello there, how are you?", "The quick brown fox", "1+1=2; 2+2="]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_model_parity(variant, tmp_path):
    model = save_hf_model(variant, tmp_path)
    lm = load_model(str(tmp_path), progress=False)
    prompts = [lm.tokenizer(t).input_ids for t in TEXTS]
    gen = Generator(lm.weights, lm.config, extra=32)   # one prefill compile for both
    for ids, got in zip(prompts, gen.logits(prompts)):
        diff = np.abs(got - hf_logits(model, ids)).max()
        assert diff < LOGITS_ATOL, f"{variant}: max |logit diff| {diff:.2e}"
    assert gen.greedy(prompts, 32) == [hf_greedy(model, ids, 32) for ids in prompts]


# ------------------------------------------------------------------ SmolLM2 (default)

SMOL_TEXTS = ["The capital of France is", "def fibonacci(n):",
              "Once upon a time, in a small village,", "List three primary colors:"]


@pytest.fixture(scope="module")
def smol(default_model):
    return default_model


@pytest.fixture(scope="module")
def smol_prompts(smol):
    tok = smol.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                   tokenize=False, add_generation_prompt=True)
    return [tok(t).input_ids for t in SMOL_TEXTS] + [tok(chat).input_ids]


@pytest.fixture(scope="module")
def hf_smol():
    """transformers' LlamaForCausalLM with weights transformers dequantized itself."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = str(default_gguf_path())
    # transformers reads the file twice (its config, then its tensors): both reads get
    # one parsed reader (a read-only view of the file) instead of parsing it again
    reader = gguf.GGUFReader(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda p, *a, **k: reader if p == path else
                   type(reader)(p, *a, **k))
        cfg = transformers.AutoConfig.for_model(**load_gguf_checkpoint(path)["config"])
        cfg._attn_implementation = "eager"   # sdpa differs by ~1e-6: enough to flip a near-tie
        with no_init_weights():   # every weight is overwritten below: skip 135M random inits
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        tensors = load_gguf_checkpoint(path, return_tensors=True,
                                       model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected   # tied head
    model.tie_weights()   # from_config under no_init_weights leaves the head untied
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model


@pytest.fixture(scope="module")
def smol_f32_tokens(smol, smol_prompts):
    return Generator(smol.weights, smol.config, extra=32).greedy(smol_prompts, 32)


@pytest.mark.slow   # ~4 min on 2 shared cores (135M params, torch reference)
def test_smollm2_greedy_matches_transformers(smol_f32_tokens, smol_prompts, hf_smol):
    assert smol_f32_tokens == [hf_greedy(hf_smol, ids, 32) for ids in smol_prompts]


@pytest.mark.slow   # ~4 min on 2 shared cores (135M params, torch reference)
def test_smollm2_formats_give_identical_logits(smol, smol_prompts, hf_smol, tmp_path):
    hf_smol.save_pretrained(tmp_path, safe_serialization=True)
    smol.tokenizer.save_pretrained(tmp_path)
    st = load_model(str(tmp_path))
    gcfg, gw = read_gguf(default_gguf_path())
    assert smol.format == st.format == "safetensors"
    assert gcfg == smol.config == st.config.replace(eos_token_ids=smol.config.eos_token_ids)
    ref = Generator(smol.weights, smol.config, extra=32).logits(smol_prompts)
    for w in (gw, st.weights):   # same shapes as the greedy run: no new compile
        got = Generator(w, smol.config, extra=32).logits(smol_prompts)
        assert all(np.array_equal(a, b) for a, b in zip(got, ref))


@pytest.mark.slow   # ~4 min on 2 shared cores (135M params, torch reference)
def test_smollm2_bfloat16_mostly_agrees(smol_f32_tokens, smol_prompts):
    bf = load_model(None, dtype="bfloat16", quantization="none")
    # 16 tokens: what the bar below reads (bfloat16 decoding on a CPU is slow)
    got = Generator(bf.weights, bf.config, extra=32).greedy(smol_prompts, 16)
    same16 = sum(a == b[:16] for a, b in zip(got, smol_f32_tokens))
    agree = np.mean([np.mean(np.array(a) == np.array(b[:16]))
                     for a, b in zip(got, smol_f32_tokens)])
    print(f"bfloat16 vs float32: {same16}/{len(got)} prompts identical for 16 tokens, "
          f"{agree:.0%} of their positions equal")
    assert same16 >= len(got) - 2
