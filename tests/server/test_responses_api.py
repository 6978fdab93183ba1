"""POST /v1/responses and GET /v1/responses/{id} on the tiny model (the shared server of
tests/server/conftest.py), with the official openai client: text, instructions, the
streamed event sequence, usage, the store (per-key scope, 404s) and the fields refused.
JSON formats and tool calls need a real tokenizer: test_responses_smollm.py."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, wait_kv_free


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def _client(server, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def _chat_text(server, messages, max_tokens: int) -> tuple[str, int]:
    r = _client(server).chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_text_and_instructions_as_chat_renders_them(server):
    c = _client(server)
    r = c.responses.create(model=MODEL_NAME, input="w5 w6", instructions="w10",
                           max_output_tokens=6, temperature=0)
    # the same prompt as chat: a system message, then the user's
    text, prompt_tokens = _chat_text(server, [{"role": "system", "content": "w10"},
                                              {"role": "user", "content": "w5 w6"}], 6)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.output_text == text and r.output[0].type == "message"
    assert r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == prompt_tokens == 4
    assert r.usage.output_tokens == len(text.split())
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "w10" and r.max_output_tokens == 6
    if r.usage.output_tokens == 6:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_input_items_and_previous_response_id(server):
    c = _client(server)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "w7"},
                                          {"type": "input_text", "text": " w8"}]}]
    first = c.responses.create(model=MODEL_NAME, input=items, max_output_tokens=3,
                               temperature=0)
    assert c.responses.retrieve(first.id).output_text == first.output_text
    second = c.responses.create(model=MODEL_NAME, input="w9", max_output_tokens=3,
                                temperature=0, previous_response_id=first.id)
    # the conversation continued: user w7 w8, the assistant's answer, user w9
    text, prompt_tokens = _chat_text(server, [
        {"role": "user", "content": "w7 w8"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "w9"}], 3)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id


def test_store_is_scoped_per_key_and_unknown_ids_are_404(server):
    a, b = _client(server, "key-a"), _client(server, "key-b")
    r = a.responses.create(model=MODEL_NAME, input="w5", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        b.responses.retrieve(r.id)
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        b.responses.create(model=MODEL_NAME, input="w5", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    assert a.responses.retrieve(r.id).id == r.id
    unstored = a.responses.create(model=MODEL_NAME, input="w5", max_output_tokens=2,
                                  store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)
    nope = httpx.get(f"{server.url}/v1/responses/resp_nope", timeout=30)
    assert nope.status_code == 404 and nope.json()["error"]["type"] == "not_found_error"


def _events(server, **kw):
    with _client(server).responses.create(model=MODEL_NAME, stream=True, temperature=0,
                                          **kw) as stream:
        return list(stream)


def test_stream_event_sequence_and_text(server):
    events = _events(server, input="w20 w21", max_output_tokens=5)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == 3
    assert final.output[0].id == events[2].item.id == events[4].item_id
    # the same text as the same request unstreamed, and stored like one
    plain = _client(server).responses.create(model=MODEL_NAME, input="w20 w21",
                                             max_output_tokens=5, temperature=0)
    assert plain.output_text == deltas
    assert _client(server).responses.retrieve(final.id).output_text == deltas


def test_stream_helper_final_response(server):
    with _client(server).responses.stream(model=MODEL_NAME, input="w30", temperature=0,
                                          max_output_tokens=4) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == deltas and final.usage.output_tokens == 4
    assert wait_kv_free(server.url)["num_free_blocks"] > 0


@pytest.mark.parametrize("body, param", [
    ({"input": "w5", "background": True}, "background"),
    ({"input": "w5", "reasoning": {"effort": "lots"}}, "reasoning"),
    ({"input": "w5", "truncation": "auto"}, "truncation"),
    ({"input": "w5", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "http://x"}]}]}, "input"),
    ({"input": "w5", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "w5", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "w5", "model": "other"}, "model"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_unsupported_and_bad_fields_name_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL_NAME, **body},
                   timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
