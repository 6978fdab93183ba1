"""Nothing compiles after warm-up, counted by jax itself: every compile request (an XLA
compile or a load from the persistent compilation cache) logs "Compiling <fn>" under
jax_log_compiles. The engine's own trace counter (num_compiles) cannot see a compile
whose trace is reused: warm-up compiled each step program for freshly created
(uncommitted) KV and step-state arrays, the real steps pass earlier steps' (committed)
outputs, and jit compiled every program again at its first real use — a few seconds per
cold start, hidden on a warm one by the persistent cache (runner._commit_state)."""
from __future__ import annotations

import pytest

from compile_log import recording_compiles
from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM

# these tests count compiles after warm-up: their engines warm up at start
pytestmark = pytest.mark.warmup


@pytest.fixture()
def compiles():
    with recording_compiles() as log:
        yield log


PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=3, logprobs=2,
                         presence_penalty=0.4, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=1.0, top_k=5, ignore_eos=True)]


@pytest.mark.parametrize("step_mode", ["layerwise", "fused", "hybrid"])
@pytest.mark.slow
def test_requests_after_warmup_compile_nothing(compiles, step_mode):
    cfg = tiny_config(num_layers=3)
    llm = LLM.from_weights(cfg, tiny_weights(cfg), tiny_tokenizer(), max_model_len=128,
                           max_num_seqs=8, max_num_batched_tokens=64, step_mode=step_mode)
    warm = list(compiles.names)
    assert warm, "jax logged no compile during warm-up: the check cannot see compiles"
    prompts = random_prompts(9, 128, 2, 60, seed=21)
    for rnd in range(2):           # the first requests, and the same ones again
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     [PARAMS[i % 3] for i in range(len(prompts))], use_tqdm=False)
        llm.generate({"prompt_token_ids": prompts[rnd]}, PARAMS[0], use_tqdm=False)
    assert compiles.names == warm, compiles.names[len(warm):]
