"""skip_tokenizer_init (vLLM's name): a checkpoint with no tokenizer files runs from
the Python API with token ids in and token ids out (text empty), and the token ids are
transformers' own greedy continuation; without the flag the missing tokenizer is a
clear error, and what needs a tokenizer says so."""
from __future__ import annotations

import pytest

from model_utils import hf_greedy, save_hf_model
from jaxserve import LLM, SamplingParams
from jaxserve.model.loader.errors import CheckpointError

SMALL = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128, block_size=16,
             num_kv_blocks=32)


@pytest.fixture(scope="module")
def no_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    model = save_hf_model("llama_gqa", path)
    for f in path.iterdir():        # leave config.json + safetensors only
        if "token" in f.name or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            f.unlink()
    assert not any("token" in f.name for f in path.iterdir())
    return path, model


def test_runs_token_ids_in_and_out(no_tokenizer_dir):
    path, model = no_tokenizer_dir
    llm = LLM(str(path), skip_tokenizer_init=True, warmup=False, **SMALL)
    assert llm.tokenizer is None
    prompts = [[1, 17, 42, 9, 100], [1, 5, 6]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.prompt_token_ids == p
        c = out.outputs[0]
        assert c.text == ""
        assert c.token_ids == hf_greedy(model, p, 6)
        assert c.finish_reason == "length"


def test_what_needs_a_tokenizer_says_so(no_tokenizer_dir):
    path, _ = no_tokenizer_dir
    llm = LLM(str(path), skip_tokenizer_init=True, warmup=False, **SMALL)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="chat templates"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_without_the_flag_the_missing_tokenizer_is_a_clear_error(no_tokenizer_dir):
    path, _ = no_tokenizer_dir
    with pytest.raises(CheckpointError, match="tokenizer"):
        LLM(str(path), warmup=False, **SMALL)


def test_serve_refuses_the_flag():
    from jaxserve.config import EngineArgs
    from jaxserve.server.launch import _serve_leader
    with pytest.raises(ValueError, match="skip-tokenizer-init"):
        _serve_leader(EngineArgs(skip_tokenizer_init=True), multihost=None)
