"""A constrained chat request on a server with --reasoning-parser, over real HTTP (in
process): the constraint starts after </think>, the reasoning is split off, and the
answer is valid JSON (response_format json_schema) or a parsed tool call (a named
function). The model: a tiny random one over the embedded model's tokenizer with
<think> and </think> added as special tokens; logit_bias steers it to </think> (the
constraint, once it holds, masks the tag away). Were the constraint to start at the
first token, </think> could never be written and all of the output would be reasoning.

The constraints run on the device automaton (it ends the answer by sampling EOS, whose
text `<|im_end|>` stays out of the content although the reasoning parser keeps special
tokens in the text)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from engine_utils import tiny_config, tiny_weights
from server_harness import MODEL_NAME, ServerThread, tiny_args

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "paint", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def server():
    from jaxserve.model.loader.default_model import default_gguf_path
    from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
    from jaxserve.server.launch import build_engine
    tok = load_gguf_tokenizer(default_gguf_path())
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    cfg = tiny_config(vocab_size=len(tok), eos_token_ids=(tok.eos_token_id,))
    args = tiny_args(max_model_len=256, num_kv_blocks=32, token_buckets=[64],
                     reasoning_parser="deepseek_r1")
    engine = build_engine(args, cfg, tiny_weights(cfg), tok, warmup=False)
    # the device path, however slowly its compile runs or starts on a busy host
    engine.core.device_structured.wait_s = 600
    engine.core.device_structured.queued_grace_s = 120.0
    srv = ServerThread(engine, tok, args)
    srv.device = engine.core.device_structured
    srv.end_id = tok.convert_tokens_to_ids("</think>")
    yield srv
    srv.stop()


def _chat(server, **body):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Pick a color."}],
        "max_tokens": 40, "temperature": 0, "logit_bias": {str(server.end_id): 100},
        **body})
    assert r.status_code == 200, r.text
    assert server.device.last_fallback is None, server.device.last_fallback
    return r.json()["choices"][0]


def test_json_schema_answer_after_the_reasoning(server):
    c = _chat(server, response_format={"type": "json_schema", "json_schema": {
        "name": "pick", "schema": SCHEMA}})
    msg = c["message"]
    assert msg["reasoning_content"] == ""          # </think> came first (the bias)
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    assert c["finish_reason"] == "stop"


def test_named_tool_call_read_after_the_reasoning(server):
    c = _chat(server, tools=[TOOL], tool_choice={"type": "function",
                                                 "function": {"name": "paint"}})
    msg = c["message"]
    assert msg["reasoning_content"] == "" and not msg["content"]
    call = msg["tool_calls"][0]["function"]
    assert call["name"] == "paint"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMA)
