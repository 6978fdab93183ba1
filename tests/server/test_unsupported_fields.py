"""No silent drops over real HTTP: a request field that would change what is generated
and that jaxserve does not implement is a 400 naming the field; the same fields with
values that mean "off", and harmless unknown fields, are served normally."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, ServerThread, tiny_args, tiny_parts


@pytest.fixture(scope="module")
def server():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args()
    engine = build_engine(args, cfg, weights, tok, warmup=True)
    srv = ServerThread(engine, tok, args)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


COMPLETION = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5 w6"}],
        "max_tokens": 2, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}

# (route, extra body, the param the 400 must name). Structured outputs (response_format,
# structured_outputs, guided_*) are served: tests/*/test_structured_outputs_*.py
REFUSED = [
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"best_of": 2, "n": 1}, "best_of"),
    ("completions", {"suffix": " and then"}, "suffix"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    # tool calling exists (tests/*/test_tool_calling_*.py); "auto" (the default with
    # tools) needs --enable-auto-tool-choice, which this server lacks
    ("chat/completions", {"tools": [TOOL]}, "tool_choice"),
    ("chat/completions", {"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ("chat/completions", {"functions": [TOOL["function"]]}, "functions"),
    ("chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, IMAGE]}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [AUDIO]}]}, "messages"),
    # a template is code: only a server started with --trust-request-chat-template runs one
    ("chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
]


@pytest.mark.parametrize("route,extra,param", REFUSED,
                         ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(REFUSED)])
def test_unsupported_field_is_a_400_naming_it(server, route, extra, param):
    base = COMPLETION if route == "completions" else CHAT
    r = httpx.post(f"{server.url}/v1/{route}", json={**base, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    first_key = next(iter(extra)) if param != "messages" else "content"
    # The message names the field (the nested one for message parts) and says why.
    assert first_key in err["message"] or param in err["message"], err
    assert "supported" in err["message"], err


# Off values of the same fields, and unknown fields that change nothing: served.
ACCEPTED = [
    ("completions", {"best_of": 1}),
    ("completions", {"best_of": 2, "n": 2}),
    ("completions", {"suffix": None}),
    ("completions", {"suffix": ""}),
    ("completions", {"response_format": {"type": "text"}}),
    ("completions", {"use_beam_search": False, "store": True, "metadata": {"a": "b"},
                     "some_future_field": [1, 2]}),
    ("chat/completions", {"tools": [], "tool_choice": "none"}),
    ("chat/completions", {"tools": [TOOL], "tool_choice": "none"}),
    ("chat/completions", {"messages": [
        {"role": "user", "content": "w5"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}),
    ("chat/completions", {"tool_choice": None, "parallel_tool_calls": False}),
    ("chat/completions", {"modalities": ["text"], "service_tier": "auto",
                          "prediction": {"type": "content", "content": "w5"}}),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "w5"}, {"type": "text", "text": " w6"}]}]}),
    ("chat/completions", {"chat_template": None, "chat_template_kwargs": {},
                          "continue_final_message": False, "echo": False,
                          "return_tokens_as_token_ids": False, "stream_options": None}),
]


@pytest.mark.parametrize("route,extra", ACCEPTED)
def test_off_values_and_harmless_fields_are_served(server, route, extra):
    base = COMPLETION if route == "completions" else CHAT
    r = httpx.post(f"{server.url}/v1/{route}", json={**base, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    n = extra.get("n", 1)
    assert len(r.json()["choices"]) == n


def test_official_client_sees_bad_request_for_auto_tools(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "w5"}], max_tokens=2,
            tools=[TOOL], tool_choice="auto")
    assert e.value.status_code == 400
    assert e.value.body["param"] == "tool_choice"


def test_official_client_sees_bad_request_for_image_and_suffix(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "w5"}, IMAGE]}])
    assert e.value.body["param"] == "messages"
    assert "text content parts" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="w5", max_tokens=2, suffix="w9")
    assert e.value.body["param"] == "suffix"
    ok = client.completions.create(model=MODEL_NAME, prompt="w5", max_tokens=2, best_of=1,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2
