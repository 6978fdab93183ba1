"""Tiny models and tokenizers for engine tests (no hub, seconds to compile)."""
from __future__ import annotations

from typing import Any

import numpy as np
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from jaxserve.model.config import ModelConfig
from jaxserve.model.params import init_params


def tiny_tokenizer(vocab_size: int = 128) -> transformers.PreTrainedTokenizerFast:
    """Word-level tokenizer: token i <-> "w{i}" (ids 0..2 are <unk>, <s>, </s>)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_config(**kw: Any) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", family="llama", vocab_size=128, hidden_size=64,
                intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                max_position_embeddings=512, eos_token_ids=(2,), bos_token_id=1)
    base.update(kw)
    return ModelConfig(**base)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> Any:
    # A larger init scale than HF's 0.02 gives peaked, input-dependent logits, so greedy
    # decoding is a sharp test (no near-ties) and outputs vary across prompts.
    return init_params(cfg, seed=seed, scale=0.25)


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, vocab, rng.integers(lo, hi + 1)))) for _ in range(n)]


def hf_model_from_weights(cfg: ModelConfig, weights: Any):
    """The transformers reference model carrying exactly our weights."""
    from jaxserve.model.export import to_transformers
    return to_transformers(cfg, weights)


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    import torch
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def core_greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens (n each, EOS ignored) of an EngineCore stepped directly."""
    from jaxserve.request import Request
    from jaxserve.sampling.params import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(Request(str(i), list(p), SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]
