"""/v1/responses pieces that need no server: the response store's bounds (LRU, time to
live, per-key scope) and the rendering of input items into chat messages."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from jaxserve.server.response_store import ResponseStore, StoredResponse, scope_of
from jaxserve.server.responses_protocol import ResponsesRequest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(rid: str) -> StoredResponse:
    return StoredResponse({"id": rid}, [{"role": "user", "content": rid}])


def test_store_is_lru_bounded_and_scoped():
    store = ResponseStore(max_entries=2, ttl=100, clock=Clock())
    a, b = scope_of("Bearer a"), scope_of("Bearer b")
    assert a != b and scope_of(None) == scope_of("")
    store.put(a, _entry("r1"))
    store.put(a, _entry("r2"))
    assert store.get(b, "r1") is None                 # another key: not found
    assert store.get(a, "r1") is not None             # r1 now the most recently used
    store.put(a, _entry("r3"))                        # evicts r2, the least recently used
    assert store.get(a, "r2") is None and store.get(a, "r1") is not None
    assert len(store) == 2


def test_store_ttl_counts_from_last_use():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl=10, clock=clock)
    store.put("s", _entry("old"))
    store.put("s", _entry("used"))
    clock.now = 8
    assert store.get("s", "used") is not None         # its time to live restarts at 8
    clock.now = 15
    assert store.get("s", "old") is None and store.get("s", "used") is not None
    assert len(store) == 1
    clock.now = 26
    assert store.get("s", "used") is None and len(store) == 0


def test_store_off():
    store = ResponseStore(max_entries=0, ttl=10)
    store.put("s", _entry("r"))
    assert store.get("s", "r") is None and len(store) == 0


def test_input_items_render_as_chat_messages():
    req = ResponsesRequest.model_validate({"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather "},
                                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"}]})
    chat = req.chat_request([{"role": "user", "content": "earlier"}])
    msgs = chat.template_messages()
    assert [m["role"] for m in msgs] == ["system", "user", "user", "assistant", "tool",
                                         "tool"]
    assert msgs[0]["content"] == "be brief" and msgs[2]["content"] == "weather in Paris?"
    assert msgs[3]["content"] == "Let me look."       # the calls join the assistant turn
    assert [c["function"]["name"] for c in msgs[3]["tool_calls"]] == ["get_weather",
                                                                      "get_time"]
    assert msgs[3]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert [(m["tool_call_id"], m["content"]) for m in msgs[4:]] == [("c1", "sunny"),
                                                                     ("c2", "noon")]


def test_fields_map_to_the_chat_request():
    req = ResponsesRequest.model_validate({
        "input": "hi", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "p", "strict": True,
                            "schema": {"type": "object"}}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}})
    chat = req.chat_request([])
    p = chat.sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p) == (7, 0.5, 0.9)
    assert p.structured_outputs.json == {"type": "object"}
    assert chat.tools[0].function.name == "f" and chat.parallel_tool_calls is False
    assert chat.tool_choice.function.name == "f"


@pytest.mark.parametrize("body, field", [
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "max_output_tokens": "7"}, "max_output_tokens"),
])
def test_refused_fields_are_named(body, field):
    with pytest.raises(ValidationError) as e:
        ResponsesRequest.model_validate(body)
    assert e.value.errors()[0]["loc"][0] == field
