"""Tool calling over real HTTP, on the tiny random model (outputs are arbitrary words,
so these tests check the request side: validation, rendering, history, `none`).
SmolLM2 runs the calls themselves: tests/server/test_tool_calling_smollm.py."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, ServerThread, tiny_args, tiny_parts

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "w7 w8",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
USER = [{"role": "user", "content": "w5 w6"}]
BASE = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}


def _serve(**kw):
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    # the fallback tool prompt is a few hundred (unknown-word) tokens
    args = tiny_args(max_model_len=512, **kw)
    return ServerThread(build_engine(args, cfg, weights, tok, warmup=False), tok, args)


@pytest.fixture(scope="module")
def servers():
    plain, auto = _serve(), _serve(enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield plain, auto
    plain.stop()
    auto.stop()


def _post(server, **body):
    return httpx.post(f"{server.url}/v1/chat/completions", json={**BASE, **body}, timeout=120)


BAD = [  # (body, param, words the message must contain)
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", ["nope", "not in tools"]),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", ["get_weather", "not in tools"]),
    ({"tool_choice": "required"}, "tool_choice", ["required", "tool"]),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", ["tool_choice"]),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", ["tools"]),
    ({"tools": [{"type": "retrieval"}]}, "tools", ["tools"]),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", ["response_format"]),
    ({"functions": [TOOL["function"]]}, "functions", ["functions", "tools"]),
    ({"function_call": {"name": "get_weather"}}, "function_call", ["function_call"]),
    ({"messages": USER + [{"role": "tool", "content": "sunny"}]}, "messages",
     ["tool_call_id"]),
    ({"messages": [{"role": "user", "content": "w5", "tool_calls": [{
        "id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages",
     ["assistant"]),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in
                                                         enumerate(BAD)])
def test_bad_tool_requests_are_400_naming_the_field(servers, body, param, words):
    for server in servers:
        r = _post(server, **body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert all(w in err["message"] for w in words), err


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "broken"}}])
def test_a_tool_schema_that_cannot_constrain_is_a_400_naming_tools(servers, choice):
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}
    r = _post(servers[0], tools=[TOOL, broken], tool_choice=choice)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "nonsense" in err["message"], err


def test_auto_needs_the_server_flag_as_in_vllm(servers):
    plain, auto = servers
    for body in ({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "auto"}):
        r = _post(plain, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        assert _post(auto, **body).status_code == 200


def test_cli_flags_reach_the_engine_args():
    import argparse

    from jaxserve.config import ConfigError, EngineArgs
    from jaxserve.cli_args import add_cli_args, engine_args_from_cli
    from jaxserve.server.tool_parsers import TOOL_PARSERS
    p = argparse.ArgumentParser()
    add_cli_args(p)
    a = engine_args_from_cli(p.parse_args(["--enable-auto-tool-choice",
                                           "--tool-call-parser", "llama3_json"]))
    assert a.enable_auto_tool_choice and a.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "mistral"])
    with pytest.raises(ConfigError, match="tool_call_parser"):
        EngineArgs(enable_auto_tool_choice=True)
    choices = next(f.metadata["choices"] for f in EngineArgs.__dataclass_fields__.values()
                   if f.name == "tool_call_parser")
    assert {c for c in choices if c} == set(TOOL_PARSERS)


def test_none_is_plain_generation_with_tools_left_out_of_the_prompt(servers):
    """tool_choice none: the same prompt and the same greedy words as no tools at all."""
    for server in servers:
        without = _post(server).json()
        none = _post(server, tools=[TOOL], tool_choice="none").json()
        assert none["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]
        msg = none["choices"][0]["message"]
        assert msg["content"] == without["choices"][0]["message"]["content"]
        assert not msg.get("tool_calls")
        assert none["choices"][0]["finish_reason"] == "length"


def test_tools_are_rendered_into_the_prompt(servers):
    """The tiny template ignores tools: the fallback system prompt carries them (more
    prompt tokens; a longer description, more still)."""
    _, auto = servers
    base = _post(auto).json()["usage"]["prompt_tokens"]
    one = _post(auto, tools=[TOOL]).json()["usage"]["prompt_tokens"]
    long_tool = {"type": "function", "function": {**TOOL["function"],
                                                  "description": "w9 " * 20}}
    longer = _post(auto, tools=[long_tool]).json()["usage"]["prompt_tokens"]
    assert base < one < longer and longer - one == 19


def test_history_with_calls_and_tool_results_is_rendered_and_served(servers):
    plain, auto = servers
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "w9"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "w10 w11"}]
    client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=3,
                                       temperature=0, tools=[TOOL], tool_choice="none",
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
    # the call and the result are in the prompt: more tokens than the user turn alone
    # (the tiny template writes only contents: "<tool_call> {...} </tool_call>" and
    # "<tool_response> w10 w11 </tool_response>" are 7 + 4 whitespace-split words)
    alone = _post(plain).json()["usage"]["prompt_tokens"]
    assert r.usage.prompt_tokens == alone + 11


def test_auto_output_without_calls_is_content(servers):
    """The tiny model writes words, never a call: content is exactly what it wrote
    (streamed and not), no tool_calls, finish_reason untouched."""
    _, auto = servers
    full = _post(auto, tools=[TOOL]).json()["choices"][0]
    assert full["finish_reason"] == "length" and not full["message"].get("tool_calls")
    client = openai.OpenAI(base_url=f"{auto.url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4,
                                            temperature=0, tools=[TOOL], stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full["message"]["content"]
    assert all(not c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_reasoning_parser_on_the_tiny_model(servers):
    """--reasoning-parser on a real engine (this module's, behind a second app, in
    process). The tiny model writes words and never </think>: under deepseek_r1 (output
    starts inside the reasoning) all of it is reasoning_content, whole and streamed;
    under qwen3 (no <think>) all of it is content."""
    from starlette.testclient import TestClient

    from jaxserve.server.api import build_app
    plain, _ = servers
    words = _post(plain).json()["choices"][0]["message"]["content"]
    engine, sink = plain.engine, plain.engine.metrics
    try:
        for parser in ("deepseek_r1", "qwen3"):
            app = build_app(engine, engine.tokenizer, model_name=MODEL_NAME,
                            args=tiny_args(max_model_len=512, reasoning_parser=parser))
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x",
                                   max_retries=0, http_client=TestClient(app))
            kw = dict(model=MODEL_NAME, messages=USER, max_tokens=4, temperature=0,
                      extra_body={"ignore_eos": True})
            msg = client.chat.completions.create(**kw).choices[0].message
            deltas = [c.choices[0].delta for c in
                      client.chat.completions.create(stream=True, **kw) if c.choices]
            streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
            content = "".join(d.content or "" for d in deltas)
            if parser == "deepseek_r1":
                assert msg.model_extra["reasoning_content"] == words and not msg.content
                assert streamed == words and content == ""
            else:
                assert msg.content == words and "reasoning_content" not in msg.model_extra
                assert content == words and streamed == ""
    finally:
        engine.metrics = sink       # build_app installed its own metrics sink
