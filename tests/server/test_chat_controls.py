"""What today's chat clients send, over HTTP (the whole app, in-process, on a scripted
engine: tests/support/scripted_engine.py): chat-template controls, echo, token-id
logprobs, continuous usage, reasoning split from the answer, tool calls streamed as
OpenAI streams them. The same on the tiny model: tests/server/test_tool_calling_api.py."""
from __future__ import annotations

import json

import openai
import pytest

from scripted_engine import ScriptedEngine, app_client, openai_client, word_tokenizer

# Qwen3's chat template in miniature: enable_thinking=false puts an empty reasoning
# block in the prompt; tools are listed in a system turn.
QWEN3ISH = (
    "{%- if tools %}<|im_start|> system tools: {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<|im_end|> {% endif %}"
    "{%- for m in messages %}<|im_start|> {{ m.role }} {{ m.content }}"
    "{% if not (loop.last and m.role == 'assistant') or add_generation_prompt %} "
    "<|im_end|>{% endif %} {% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|> assistant "
    "{%- if enable_thinking is defined and enable_thinking is false %} <think> </think>"
    "{%- endif %}{% endif %}")
USER = [{"role": "user", "content": "w5 w6"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _tokenizer():
    tok = word_tokenizer()
    tok.chat_template = QWEN3ISH
    return tok


TOK = _tokenizer()


def _serve(pieces, **args):
    engine = ScriptedEngine(pieces)
    return engine, app_client(engine, TOK, **args)


def _prompt(engine) -> str:
    return TOK.decode(engine.prompts[-1])


def _chat(http, **body):
    return http.post("/v1/chat/completions", json={"messages": USER, **body})


def _error(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert param in err["message"], err
    return err


# ---- chat-template controls ------------------------------------------------------------
def test_enable_thinking_reaches_the_template():
    engine, http = _serve(["w9"])
    assert _chat(http).status_code == 200
    assert _prompt(engine) == "<|im_start|> user w5 w6 <|im_end|> <|im_start|> assistant"
    assert _chat(http, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    assert _prompt(engine).endswith("assistant <think> </think>")
    tok = http.post("/tokenize", json={"messages": USER,
                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert tok.json()["tokens"] == engine.prompts[-1]
    _error(_chat(http, chat_template_kwargs={"tokenize": False}), "chat_template_kwargs")


def test_a_request_template_needs_the_server_flag():
    template = "{% for m in messages %}w7 {{ m.content }} {% endfor %}"
    _, plain = _serve(["w9"])
    err = _error(_chat(plain, chat_template=template), "chat_template")
    assert "--trust-request-chat-template" in err["message"]
    _error(plain.post("/tokenize", json={"messages": USER, "chat_template": template}),
           "chat_template")
    engine, trusting = _serve(["w9"], trust_request_chat_template=True)
    assert _chat(trusting, chat_template=template).status_code == 200
    assert _prompt(engine) == "w7 w5 w6"
    _error(_chat(trusting, chat_template="{% for %}"), "chat_template")   # broken: 400


def test_continue_final_message_leaves_the_turn_open_and_echo_repeats_it():
    engine, http = _serve([" w9", " w10"])
    msgs = USER + [{"role": "assistant", "content": "w7 w8"}]
    err = _error(_chat(http, messages=msgs, continue_final_message=True),
                 "continue_final_message")
    assert "add_generation_prompt" in err["message"]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
            "echo": True}
    r = _chat(http, **body)
    assert _prompt(engine).endswith("<|im_start|> assistant w7 w8")     # no <|im_end|>
    assert r.json()["choices"][0]["message"]["content"] == "w7 w8 w9 w10"
    client = openai_client(http)
    chunks = list(client.chat.completions.create(model="m", stream=True, messages=msgs,
                                                 extra_body={**body, "messages": msgs}))
    assert chunks[0].choices[0].delta.content.startswith("w7 w8")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "w7 w8 w9 w10"
    # echo repeats only the assistant's own last message (vLLM's rule)
    assert _chat(http, echo=True).json()["choices"][0]["message"]["content"] == " w9 w10"


def test_tokenize_renders_tools_as_chat_does():
    engine, http = _serve(['[{"name": "get_weather", "parameters": {}}]'])
    plain = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    with_tools = http.post("/tokenize", json={"messages": USER, "tools": [TOOL]}).json()
    assert TOK.decode(with_tools["tokens"]).startswith("<|im_start|> system tools: <unk>")
    assert with_tools["count"] == len(plain) + 5
    assert _chat(http, tools=[TOOL], tool_choice="required").status_code == 200
    assert engine.prompts[-1] == with_tools["tokens"]


# ---- logprobs as token ids, usage on every chunk, stream_options --------------------------
def test_return_tokens_as_token_ids():
    _, http = _serve(["w9", " w10"])
    lp = _chat(http, logprobs=True, top_logprobs=2,
               return_tokens_as_token_ids=True).json()["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in lp] == ["token_id:20", "token_id:21"]
    assert [t["token"] for t in lp[0]["top_logprobs"]] == ["token_id:20", "token_id:3"]
    r = http.post("/v1/completions", json={"prompt": "w5", "logprobs": 1, "echo": True,
                                           "return_tokens_as_token_ids": True}).json()
    assert r["choices"][0]["logprobs"]["tokens"][-2:] == ["token_id:20", "token_id:21"]
    plain = _chat(http, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in plain] == ["w9", "w10"]     # ids 20, 21 (word_tokenizer)


def test_continuous_usage_stats_and_stream_options_need_stream():
    _, http = _serve(["w9", " w10", " w11"])
    client = openai_client(http)
    for route in ("chat", "completions"):
        kw = {"messages": USER} if route == "chat" else {"prompt": "w5 w6"}
        make = client.chat.completions.create if route == "chat" else \
            client.completions.create
        chunks = list(make(model="m", stream=True, **kw, stream_options={
            "include_usage": True, "continuous_usage_stats": True}))
        assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 3]
        assert not chunks[-1].choices and chunks[-1].usage.total_tokens > 3
        r = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                      json={**kw, "stream_options": {"include_usage": True}})
        _error(r, "stream_options")


# ---- reasoning ------------------------------------------------------------------------------
THINKING = ["Let me ", "think.</th", "ink>\n\nThe ", "answer."]


def test_deepseek_r1_reasoning_whole_and_streamed():
    _, http = _serve(THINKING, reasoning_parser="deepseek_r1")
    msg = _chat(http).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "Let me think." and msg["content"] == "The answer."
    chunks = list(openai_client(http).chat.completions.create(model="m", messages=USER,
                                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = [d.model_extra.get("reasoning_content") or "" for d in deltas]
    content = [d.content or "" for d in deltas]
    assert "".join(reasoning) == "Let me think." and "".join(content) == "The answer."
    first_answer = next(i for i, c in enumerate(content) if c)
    assert not any(reasoning[first_answer:])       # reasoning, then the answer
    assert not any("</th" in x or "ink>" in x for x in reasoning + content)


def test_qwen3_reasoning_only_with_think_and_off_with_enable_thinking_false():
    _, http = _serve(["<think>", "hmm</think>", "w9"], reasoning_parser="qwen3")
    msg = _chat(http).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "hmm" and msg["content"] == "w9"
    engine, http = _serve(["w9 w10"], reasoning_parser="qwen3")
    msg = _chat(http, chat_template_kwargs={"enable_thinking": False}).json()
    assert _prompt(engine).endswith("<think> </think>")
    assert msg["choices"][0]["message"] == {"role": "assistant", "content": "w9 w10"}


def _usages(pieces, parser, **body):
    """A chat request's usage, whole and streamed (the final usage chunk); each piece
    is the tokens its words encode to."""
    engine = ScriptedEngine(pieces, tokenizer=TOK)
    http = app_client(engine, TOK, **({"reasoning_parser": parser} if parser else {}))
    whole = _chat(http, **body).json()["usage"]
    chunks = list(openai_client(http).chat.completions.create(
        model="m", messages=USER, stream=True, stream_options={"include_usage": True},
        **body))
    streamed = chunks[-1].usage.model_dump(exclude_none=True)
    assert whole["completion_tokens"] == streamed["completion_tokens"]
    return whole, streamed


def _reasoning_tokens(pieces, parser, **body):
    """(reasoning tokens, completion tokens), the same whole and streamed; None
    without completion_tokens_details."""
    whole, streamed = _usages(pieces, parser, **body)
    counts = [(u.get("completion_tokens_details") or {}).get("reasoning_tokens")
              for u in (whole, streamed)]
    assert counts[0] == counts[1], (whole, streamed)
    return counts[0], whole["completion_tokens"]


def test_usage_counts_the_reasoning_tokens():
    thought = ["<think>", "w5 w6", "</think>", "w9 w10"]     # 4 reasoning tokens of 6
    assert _reasoning_tokens(thought, "deepseek_r1") == (4, 6)
    assert _reasoning_tokens(thought, "qwen3") == (4, 6)
    assert _reasoning_tokens(thought, "deepseek_r1", n=2) == (8, 12)    # summed
    # deepseek_r1 starts inside the reasoning: never closed, all of it is reasoning
    assert _reasoning_tokens(["w5 ", "w6 w7"], "deepseek_r1") == (3, 3)
    assert _reasoning_tokens(["w5", "</think>", "w9"], "deepseek_r1") == (2, 3)
    # qwen3 without <think>: no reasoning, even with a </think> later
    assert _reasoning_tokens(["w9 w10"], "qwen3") == (0, 2)
    assert _reasoning_tokens(["w9", "</think>", "w10"], "qwen3") == (0, 3)
    # no reasoning parser: no completion_tokens_details
    assert _reasoning_tokens(thought, None) == (None, 6)


def test_tool_calls_and_json_read_the_answer_after_reasoning():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "w5"}}</tool_call>'
    _, http = _serve(["I should call.</think>", call], reasoning_parser="deepseek_r1",
                     enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = _chat(http, tools=[TOOL]).json()["choices"][0]
    assert r["message"]["reasoning_content"] == "I should call."
    assert r["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert r["finish_reason"] == "tool_calls"
    # a constrained output's grammar starts after </think> (its token ids reach the
    # engine with the constraint), and the answer after the reasoning is the JSON
    engine, http = _serve(["hmm</think>", '{"a": ', "1}"], reasoning_parser="deepseek_r1")
    msg = _chat(http, response_format={"type": "json_object"}).json()["choices"][0]["message"]
    assert json.loads(msg["content"]) == {"a": 1} and msg["reasoning_content"] == "hmm"
    assert engine.params[-1].structured_outputs.reasoning_end == TOK.encode(
        "</think>", add_special_tokens=False)


def test_constraint_from_the_first_token_without_thinking():
    """qwen3 with enable_thinking=false cannot reason: its constraint holds at once."""
    engine, http = _serve(['{"a": 1}'], reasoning_parser="qwen3")
    r = _chat(http, response_format={"type": "json_object"},
              chat_template_kwargs={"enable_thinking": False}).json()
    assert json.loads(r["choices"][0]["message"]["content"]) == {"a": 1}
    assert engine.params[-1].structured_outputs.reasoning_end is None
    _chat(http, response_format={"type": "json_object"})
    assert engine.params[-1].structured_outputs.reasoning_end is not None


# ---- tool calls streamed as OpenAI streams them -----------------------------------------------
CITY = "w5 " * 30


def _pieces(text: str, size: int = 7) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("choice,output", [
    ("auto", '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "%s"}}]'),
])
def test_streamed_tool_call_arguments_arrive_in_fragments(choice, output):
    _, http = _serve(_pieces(output % CITY), enable_auto_tool_choice=True,
                     tool_call_parser="hermes")
    client = openai_client(http)
    chunks = list(client.chat.completions.create(model="m", messages=USER, tools=[TOOL],
                                                 tool_choice=choice, stream=True))
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    head = calls[0]
    assert head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    fragments = [tc.function.arguments for tc in calls[1:]]
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:])
    assert len(fragments) > 3
    assert json.loads("".join(fragments)) == {"city": CITY}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the client's own reassembly gets the same call
    with client.chat.completions.stream(model="m", messages=USER, tools=[TOOL],
                                        tool_choice=choice) as s:
        final = s.get_final_completion()
    (tc,) = final.choices[0].message.tool_calls
    assert tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": CITY}


def test_official_client_sees_the_400s():
    _, http = _serve(["w9"])
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(http).chat.completions.create(
            model="m", messages=USER, extra_body={"chat_template": "{{ 1 }}"})
    assert e.value.body["param"] == "chat_template"


def test_cli_flags_reach_the_engine_args(capsys):
    import argparse

    from jaxserve.config import EngineArgs
    from jaxserve.cli_args import add_cli_args, engine_args_from_cli
    from jaxserve.server.reasoning import REASONING_PARSERS
    p = argparse.ArgumentParser()
    add_cli_args(p)
    a = engine_args_from_cli(p.parse_args(["--reasoning-parser", "qwen3",
                                           "--trust-request-chat-template"]))
    assert a.reasoning_parser == "qwen3" and a.trust_request_chat_template
    assert not EngineArgs().trust_request_chat_template
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "granite"])
    choices = next(f.metadata["choices"] for f in EngineArgs.__dataclass_fields__.values()
                   if f.name == "reasoning_parser")
    assert {c for c in choices if c} == set(REASONING_PARSERS)
