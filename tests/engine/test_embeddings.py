"""Embeddings through the engine (LLM.embed) on a tiny random Qwen3 checkpoint saved as a
sentence-transformers model (mean pooling, normalised), against transformers' AutoModel.

One engine with a 16-token step budget: a batch of mixed lengths, with inputs up to
max_model_len tokens (eight chunks, so mean pooling adds chunks up), matches the
reference within cosine 0.9999; the same inputs again (their KV blocks now in the prefix
cache) compute every position anew and match again; every KV block is free afterwards;
`dimensions` cuts and re-normalises; an input over max_model_len is refused with OpenAI's
context-length message; nothing compiles after warm-up.
"""
from __future__ import annotations

import numpy as np
import pytest

from embed_utils import cosine, reference_embeddings, save_embedding_checkpoint
from jaxserve.frontend.llm import LLM
from jaxserve.model.pooling import PoolingConfig
from jaxserve.sampling.params import SamplingParamsError

MAX_LEN = 128
ENGINE = dict(max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=[4, 16], num_kv_blocks=40, block_size=8, dtype="float32")
LENGTHS = [1, 5, 16, 17, 40, MAX_LEN]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = save_embedding_checkpoint(tmp_path_factory.mktemp("st_mean"), pooling="mean")
    llm = LLM(str(ckpt), **ENGINE)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(3, 128, n))) for n in LENGTHS]
    raw = reference_embeddings(ckpt, prompts, "mean", normalize=False)
    return llm, prompts, raw


def _embed(llm: LLM, prompts: list[list[int]], **kw) -> list[np.ndarray]:
    return llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **kw)


@pytest.mark.warmup
def test_mean_pooling_matches_transformers_chunked_and_frees_every_block(setup):
    llm, prompts, raw = setup
    assert llm.engine.pooling == PoolingConfig("mean", True)    # from 1_Pooling + Normalize
    warm = llm.num_compiles
    kv = llm.engine.kv_manager
    for round_ in range(2):     # the second time every full block is in the prefix cache
        hits = kv.stats.hits
        got = _embed(llm, prompts)
        for p, g, r in zip(prompts, got, raw):
            assert cosine(g, r) >= 0.9999, (round_, len(p), cosine(g, r))
            assert abs(np.linalg.norm(g) - 1) < 1e-5
        assert kv.stats.hits == hits        # no prefix-cache shortcut was taken
        assert kv.num_free_blocks == kv.num_blocks
    assert llm.num_compiles == warm


def test_dimensions_cut_then_renormalise(setup):
    llm, prompts, raw = setup
    got = _embed(llm, prompts[2:4], dimensions=16)
    for g, r in zip(got, raw[2:4]):
        assert g.shape == (16,) and abs(np.linalg.norm(g) - 1) < 1e-5
        assert cosine(g, r[:16]) >= 0.9999


def test_context_length_bound(setup):
    llm, prompts, _ = setup
    with pytest.raises(SamplingParamsError, match=f"maximum context length is {MAX_LEN} "
                       f"tokens. However, you requested {MAX_LEN + 1} tokens") as e:
        _embed(llm, [prompts[-1] + [5]])
    assert e.value.code == "context_length_exceeded"
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
