"""Tool calls end to end on SmolLM2-135M-Instruct over real HTTP with the official
client: tool_choice required and named (grammar-constrained to the tools' schemas), and
auto (the hermes parser reading what the model writes), streamed and not. Every call
must parse and its arguments must validate against its tool's JSON schema."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from server_harness import MODEL_NAME, ServerThread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(default_model):
    from jaxserve.config import EngineArgs
    from jaxserve.server.launch import build_engine
    m = default_model
    args = EngineArgs(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256,
                      token_buckets=[8, 256], block_size=16, num_kv_blocks=320,
                      served_model_name=MODEL_NAME, port=0, enable_auto_tool_choice=True,
                      tool_call_parser="hermes")
    srv = ServerThread(build_engine(args, m.config, m.weights, m.tokenizer, warmup=True),
                       m.tokenizer, args)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                         timeout=300)


def _create(client, **kw):
    kw = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "temperature": 0,
          "max_tokens": 80, **kw}
    return client.chat.completions.create(**kw)


def _streamed(client, **kw):
    """The stream folded into (content or None, [(id, name, arguments)], finish_reason)
    as OpenAI's clients fold it: by tool call index, the name from the first piece,
    arguments concatenated."""
    content, calls, reason = "", {}, None
    for chunk in _create(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.id.startswith("call_") and tc.function.name
                    assert tc.type == "function"
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            reason = c.finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


def _both(client, **kw):
    """The request sent plain and streamed at the same time: -> (response, _streamed
    fold). Run together, the two share the engine's steps (a decode step costs about
    the same for one sequence as for two on a CPU), and both are greedy on the same
    prompt, so they must still agree token for token."""
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(_create, client, **kw)
        streamed = pool.submit(_streamed, client, **kw)
        return plain.result(), streamed.result()


def _valid(name, arguments):
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _calls(message):
    out = []
    for c in message.tool_calls or []:
        assert c.id.startswith("call_") and c.type == "function"
        _valid(c.function.name, c.function.arguments)
        out.append((c.function.name, json.loads(c.function.arguments)))
    return out


def test_required_gives_valid_calls_streamed_and_not(client):
    r, (content, streamed, reason) = _both(client, tool_choice="required")
    choice = r.choices[0]
    calls = _calls(choice.message)
    assert calls and choice.finish_reason == "tool_calls" and choice.message.content is None
    assert content is None and reason == "tool_calls"
    assert [(n, _valid(n, a)) for _, n, a in streamed] == calls     # same greedy tokens


def test_required_samples_are_all_valid_calls(client):
    """Sampled at temperature 1: every sample holds at least one call and every call
    validates (a sample cut off by max_tokens keeps its complete calls). A call is
    about 30 tokens: 96 leave room for a few, and a sample that goes on calling is
    cut off."""
    r = _create(client, tool_choice="required", temperature=1.0, n=4, seed=7,
                max_tokens=96)
    assert len(r.choices) == 4
    for choice in r.choices:
        assert _calls(choice.message), choice
        assert choice.finish_reason in ("tool_calls", "length")


def test_named_function_gives_one_valid_call_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r, (content, streamed, reason) = _both(client, tool_choice=named)
    choice = r.choices[0]
    calls = _calls(choice.message)
    assert [n for n, _ in calls] == ["get_time"]
    assert choice.finish_reason == "stop"           # OpenAI's for a forced function
    assert content is None and reason == "stop"
    assert [(n, _valid(n, a)) for _, n, a in streamed] == calls


CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>')


PREFIXES = ["", "Let me look that up.\n"]


@pytest.fixture(scope="module")
def auto_driven(client):
    """prefix -> _both's answers for the output driven to prefix + CALL. The four
    requests (each prefix plain and streamed) go out together: they fill the server's
    four sequences and share its steps."""
    with ThreadPoolExecutor(len(PREFIXES)) as pool:
        answers = {p: pool.submit(_both, client, tool_choice="auto", extra_body={
            "structured_outputs": {"choice": [p + CALL]}}) for p in PREFIXES}
        return {p: a.result() for p, a in answers.items()}


@pytest.mark.parametrize("prefix", PREFIXES)
def test_auto_reads_the_calls_the_model_writes(auto_driven, prefix):
    """The model's output driven by a constraint (the one allowed text) to a hermes
    call, so the test does not hang on what a 135M model decides: the auto path must
    turn it into content + one call, streamed (token pieces) and not."""
    r, (content, streamed, reason) = auto_driven[prefix]
    choice = r.choices[0]
    want = [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert _calls(choice.message) == want
    assert choice.message.content == (prefix.strip() or None)
    assert choice.finish_reason == "tool_calls"
    assert content == (prefix.strip() or None) and reason == "tool_calls"
    assert [(n, _valid(n, a)) for _, n, a in streamed] == want


def _worked(city, call_id, weather):
    return [{"role": "user", "content": f"What is the weather like in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function", "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": weather},
            {"role": "assistant", "content": f"It is {weather} in {city}."}]


def test_auto_with_worked_examples_in_history(client):
    """Unconstrained greedy: after two worked calls in the history (one alone was not
    enough: SmolLM2 then imitated the tool's result instead), the model writes the
    next call itself in the same format; it must come back parsed and valid."""
    history = (_worked("London", "call_0", "rainy, 12 C")
               + _worked("Berlin", "call_1", "cloudy, 15 C")
               + [{"role": "user", "content": "What is the weather like in Paris?"}])
    r, (content, streamed, reason) = _both(client, messages=history, tool_choice="auto")
    calls = _calls(r.choices[0].message)
    assert [(n, a["city"]) for n, a in calls] == [("get_weather", "Paris")], \
        r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert content is None and reason == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in streamed] == calls


def test_a_tool_result_in_history_is_answered_as_content(client):
    history = [ASK[0], {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"}]
    r = _create(client, messages=history, tool_choice="none", max_tokens=12)
    msg = r.choices[0].message
    assert msg.tool_calls is None and isinstance(msg.content, str) and msg.content
