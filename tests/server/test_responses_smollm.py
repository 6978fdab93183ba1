"""/v1/responses where a real tokenizer is needed, on SmolLM2-135M-Instruct (the shared
server of tests/server/conftest.py): text.format json_schema, and a function tool round
trip (call, then its output sent back with previous_response_id), plain and streamed.
Each is checked against the chat request it stands for."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_harness import MODEL_NAME

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "city": {"enum": ["Paris", "Tokyo", "Lima"]}},
    "required": ["name", "city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
            "required": ["city"], "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in
                                              ("name", "description", "parameters")}}
ASK = "What is the weather in Paris?"
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(smollm_server):
    return openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="x", max_retries=0,
                         timeout=600)


def test_json_schema_format(client):
    r = client.responses.create(
        model=MODEL_NAME, input="Invent a person with a name and a city, as JSON.",
        max_output_tokens=48, temperature=0, text={"format": {
            "type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL_NAME, input=ASK, tools=[TOOL],
                                    tool_choice=NAMED, max_output_tokens=32, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", first.output
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Tokyo")
    call = calls[0]
    second = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, tools=[TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 21 C"}], max_output_tokens=12, temperature=0)
    # the chat request it stands for: the question, the call, its result
    chat = client.chat.completions.create(
        model=MODEL_NAME, tools=[CHAT_TOOL], tool_choice="none", max_tokens=12,
        temperature=0, messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_function_call(client):
    with client.responses.stream(model=MODEL_NAME, input=ASK, tools=[TOOL],
                                 tool_choice=NAMED, max_output_tokens=32,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    (item,) = final.output
    assert item.type == "function_call" and item.arguments == args == events[-3].arguments
    assert json.loads(args)["city"] in ("Paris", "Tokyo")
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_auto_tool_choice_needs_the_server_flag(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input=ASK, tools=[TOOL])
    assert e.value.body["param"] == "tool_choice"
