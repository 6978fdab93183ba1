"""Request validation that cannot be bypassed: each attack from the
review, over real HTTP (400 naming the param; the server keeps answering) and through
`LLM.generate` (ValueError naming the param; the engine keeps working).

The truth for "survives" is a normal request answered afterwards and /health 200; for
the limits, the documented defaults (EngineArgs) and the definition of each check."""
from __future__ import annotations

import argparse
import json
import random
import time

import httpx
import pytest

from engine_utils import tiny_config, tiny_tokenizer, tiny_weights
from server_harness import MODEL_NAME, ServerThread, tiny_args, tiny_parts
from jaxserve.config import EngineArgs
from jaxserve.cli_args import add_cli_args
from jaxserve.frontend.input_processor import InputLimits, InputProcessor
from jaxserve.frontend.llm import LLM
from jaxserve.sampling.params import SamplingParams, SamplingParamsError
from jaxserve.frontend.stop_strings import _partial_stop_len

V, MAX_LEN = 128, 128          # the tiny model's vocabulary and the harness' max_model_len
D = EngineArgs()               # documented default limits


@pytest.fixture(scope="module")
def server():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args()
    srv = ServerThread(build_engine(args, cfg, weights, tok, warmup=False), tok, args)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm():
    cfg = tiny_config()
    return LLM.from_weights(cfg, tiny_weights(cfg), tiny_tokenizer(), warmup=False,
                            max_model_len=MAX_LEN, max_num_seqs=8, token_buckets=[16, 64])


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json"})


def _bad(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err


def _chat(**kw) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5 w6"}], **kw}


def _cmpl(**kw) -> dict:
    return {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 2, **kw}


def _assert_serving(server) -> None:
    r = _post(server, "/v1/chat/completions", _chat(max_tokens=3, temperature=0,
                                                    ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- HTTP ---------------------------------------------------------------------------------
def test_min_tokens_above_default_max_tokens_is_400_and_engine_lives(server):
    # The confirmed crash: no max_tokens, so the check min <= max used to be skipped and
    # 3e9 reached an int32 array on the engine thread, which died (/health 503).
    _bad(_post(server, "/v1/chat/completions", _chat(min_tokens=3_000_000_000)), "min_tokens")
    # Below int32 but above the default max_tokens (128 - 3 prompt tokens): same check.
    err = _bad(_post(server, "/v1/chat/completions", _chat(min_tokens=200)), "min_tokens")
    assert "defaults to 125" in err["message"]
    _assert_serving(server)


def test_min_tokens_up_to_default_max_tokens_is_accepted(server):
    # The prompt "w5 w6 w3" (template) is 3 tokens: the default max_tokens is 125.
    r = _post(server, "/v1/chat/completions", _chat(min_tokens=MAX_LEN - 3, temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_LEN - 3


@pytest.mark.parametrize("field,value", [
    ("temperature", 1e39), ("temperature", 3.5e38), ("repetition_penalty", 1e39),
    ("repetition_penalty", 1e-30), ("top_p", 1e-50), ("top_k", 2 ** 40),
    ("min_tokens", 2 ** 40), ("max_tokens", 2 ** 40), ("seed", 2 ** 63 - 1 + 1)])
def test_out_of_device_range_numbers_are_400(server, field, value):
    # finite doubles that are inf/0 in float32, ints beyond int32 (seed: beyond int64)
    _bad(_post(server, "/v1/completions", _cmpl(**{field: value})), field)


def test_stop_strings_bounded(server):
    _bad(_post(server, "/v1/completions", _cmpl(stop=[f"s{i}" for i in range(10_000)])),
         "stop")                                              # over the hard ceiling
    _bad(_post(server, "/v1/completions",
               _cmpl(stop=[f"s{i}" for i in range(D.max_stop_strings + 1)])), "stop")
    _bad(_post(server, "/v1/completions", _cmpl(stop=["x" * 100_000])), "stop")
    _bad(_post(server, "/v1/completions",
               _cmpl(stop=["x" * (D.max_stop_string_chars + 1)])), "stop")
    ok = _post(server, "/v1/completions", _cmpl(
        stop=["x" * D.max_stop_string_chars] * D.max_stop_strings))
    assert ok.status_code == 200, ok.text


def test_stop_token_ids_bounded(server):
    _bad(_post(server, "/v1/completions", _cmpl(stop_token_ids=[5] * 5000)), "stop_token_ids")
    _bad(_post(server, "/v1/completions",
               _cmpl(stop_token_ids=[5] * (D.max_stop_token_ids + 1))), "stop_token_ids")
    assert _post(server, "/v1/completions",
                 _cmpl(stop_token_ids=[5] * D.max_stop_token_ids)).status_code == 200


def test_logit_bias_bounded(server):
    bias = {str(i): 1.0 for i in range(3, 3 + D.max_logit_bias + 1)}
    _bad(_post(server, "/v1/completions", _cmpl(logit_bias=bias)), "logit_bias")
    _bad(_post(server, "/v1/completions",
               _cmpl(logit_bias={str(i): 1.0 for i in range(300)})), "logit_bias")


def test_million_prompts_is_400_quickly(server):
    body = '{"model": "%s", "max_tokens": 1, "n": 16, "prompt": [%s]}' % (
        MODEL_NAME, ",".join(["[5]"] * 1_000_000))          # ~4 MB, under the body limit
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=120,
                   headers={"content-type": "application/json"})
    elapsed = time.monotonic() - t0
    _bad(r, "prompt")
    assert elapsed < 15, elapsed          # json parse only; no validation of 1M items
    _assert_serving(server)


def test_prompts_times_n_bounded(server):
    limit = D.max_sequences_per_request
    _bad(_post(server, "/v1/completions", _cmpl(prompt=[[5]] * (limit + 1))), "prompt")
    _bad(_post(server, "/v1/completions", _cmpl(prompt=[[5]] * 100, n=16)), "n")


@pytest.mark.parametrize("prompt", [[5, V], [-1], [5, 2 ** 70], [[5], [V + 7]]])
def test_out_of_vocab_prompt_ids_are_400(server, prompt):
    _bad(_post(server, "/v1/completions", _cmpl(prompt=prompt)), "prompt")


def test_input_characters_bounded_before_tokenization(server):
    big = "w5 " * (D.max_input_chars // 3 + 1)
    _bad(_post(server, "/v1/completions", _cmpl(prompt=big)), "prompt")
    _bad(_post(server, "/v1/chat/completions",
               {"model": MODEL_NAME, "messages": [{"role": "user", "content": big}]}),
         "messages")


def test_context_length_error_keeps_openai_code(server):
    err = _bad(_post(server, "/v1/completions", _cmpl(max_tokens=MAX_LEN)), "max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert err["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{MAX_LEN + 2} tokens (2 in the prompt, {MAX_LEN} in the completion). Please "
        "reduce the length of the prompt or completion.")
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}],
            "max_tokens": MAX_LEN}
    err = _bad(_post(server, "/v1/chat/completions", chat), "max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert "in the messages" in err["message"] and "reduce the length of the messages" \
        in err["message"]
    _assert_serving(server)


# ---- Python API: the same checks raise ValueError naming the parameter ---------------------
BAD_PY = [
    ("min_tokens", [5, 6], dict(min_tokens=3_000_000_000, max_tokens=None)),
    ("min_tokens", [5, 6], dict(min_tokens=127, max_tokens=None)),     # default max is 126
    ("temperature", [5, 6], dict(temperature=1e39)),
    ("stop", [5, 6], dict(stop=[f"s{i}" for i in range(10_000)])),
    ("stop", [5, 6], dict(stop=["x" * 100_000])),
    ("stop_token_ids", [5, 6], dict(stop_token_ids=[5] * 5000)),
    ("logit_bias", [5, 6], dict(logit_bias={i: 1.0 for i in range(300)})),
    ("prompt", [5, V], {}), ("prompt", [-1], {}), ("prompt", [2 ** 40], {}),
    ("prompt", "w5 " * (D.max_input_chars // 3 + 1), {}),
    ("max_tokens", [5, 6], dict(max_tokens=MAX_LEN)),
]


@pytest.mark.parametrize("param,prompt,kw", BAD_PY,
                         ids=[f"{i}-{p}" for i, (p, _, _) in enumerate(BAD_PY)])
def test_llm_generate_raises_value_error(llm, param, prompt, kw):
    with pytest.raises(ValueError) as e:
        llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)
    assert isinstance(e.value, SamplingParamsError) and e.value.param == param, e.value
    assert not llm.engine.has_unfinished_requests()


def test_llm_still_generates_after_rejections(llm):
    out = llm.generate([5, 6], SamplingParams(max_tokens=None, min_tokens=MAX_LEN - 2,
                                              temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == MAX_LEN - 2


# ---- the pieces ------------------------------------------------------------------------------
def test_defaults_then_validation_order():
    inputs = InputProcessor(InputLimits(), vocab_size=V, max_model_len=100)
    ids, final = inputs.process([5] * 10, SamplingParams(max_tokens=None, min_tokens=90))
    assert final.max_tokens == 90 and ids == [5] * 10
    with pytest.raises(SamplingParamsError) as e:
        inputs.process([5] * 10, SamplingParams(max_tokens=None, min_tokens=91))
    assert e.value.param == "min_tokens"


def test_limits_are_cli_flags_with_help():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    text = p.format_help()
    for name in ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                 "max_logit_bias", "max_sequences_per_request", "max_input_chars"):
        assert "--" + name.replace("_", "-") in text, name
    limits = InputLimits.from_args(EngineArgs(max_stop_strings=2))
    with pytest.raises(SamplingParamsError, match="at most 2"):
        InputProcessor(limits, vocab_size=V, max_model_len=100).check_params(
            SamplingParams(stop=["a", "b", "c"]))


def _partial_by_definition(text: str, stops: list[str]) -> int:
    return max([n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:n])], default=0)


def test_partial_stop_len_matches_definition():
    rng = random.Random(0)
    for _ in range(5000):
        alpha = rng.choice(["ab", "abc", "a b\n"])
        text = "".join(rng.choice(alpha) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alpha) for _ in range(rng.randint(1, 12)))
                 for _ in range(rng.randint(1, 3))]
        assert _partial_stop_len(text, stops) == _partial_by_definition(text, stops), \
            (text, stops)
