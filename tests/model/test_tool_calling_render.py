"""Tools through chat templates (host only): a template that renders tools gets them
and the history in OpenAI's shape; one that ignores them (SmolLM2's) gets the fallback
system prompt and calls / results written into the text (docs/serving.md)."""
from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from jaxserve.server.chat_template import ChatRenderer, fallback_messages
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.tool_parsers import (HermesToolParser, Llama3JsonToolParser,
                                          parse_all)

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
# A template that renders tools, calls (arguments through tojson, so they must be a
# dict, not a JSON string) and tool results, like Qwen's / Llama 3.1's do.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }}: {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


def char_tokenizer(template: str) -> transformers.PreTrainedTokenizerFast:
    """One token per character (so the decoded ids are exactly the rendered text)."""
    vocab = {"<unk>": 0, **{chr(i): i - 30 for i in range(32, 127)}, "\n": 97}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    t.chat_template = template
    return t


def _text(tok, ids):
    inv = {v: k for k, v in tok.get_vocab().items()}
    return "".join(inv[i] for i in ids)


def _messages(msgs):
    return ChatCompletionRequest(messages=msgs).template_messages()


def test_a_template_that_renders_tools_gets_them_natively():
    tok = char_tokenizer(TOOL_TEMPLATE)
    r = ChatRenderer(tok)
    assert r.takes_tools()
    text = _text(tok, r.render(_messages(HISTORY), [TOOL], HermesToolParser))
    assert text == ("TOOLS:get_weather;|[user]Weather in Paris?|"
                    '[assistant]CALL get_weather {"city": "Paris"}|'
                    "[tool]RESULT call_1: sunny, 21 C|[assistant]")


@pytest.fixture(scope="module")
def smollm():
    from jaxserve.model.loader.default_model import default_model_path
    from jaxserve.model.tokenizer.load import load_tokenizer
    return load_tokenizer(default_model_path())


def test_smollm2_template_ignores_tools_so_the_fallback_writes_them(smollm):
    r = ChatRenderer(smollm)
    assert not r.takes_tools()
    text = smollm.decode(r.render(_messages(HISTORY), [TOOL], HermesToolParser))
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n")       # replaces the default one
    assert "SmolLM" not in system and json.dumps(TOOL) in system
    assert "<tool_call>" in system and '"arguments"' in system
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rest == ("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                    f"<|im_start|>assistant\n{call}<|im_end|>\n"
                    "<|im_start|>tool\n<tool_response>\nsunny, 21 C\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    # what the fallback writes for a past call, the parser reads back
    content, calls = parse_all(HermesToolParser(), call)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_fallback_joins_the_conversations_system_message_and_uses_the_parsers_format():
    msgs = [{"role": "system", "content": "Be brief."}] + _messages(HISTORY)
    out = fallback_messages(msgs, [TOOL], Llama3JsonToolParser)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"parameters"' in out[0]["content"]
    call = out[2]["content"]
    assert call == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls = parse_all(Llama3JsonToolParser(), call)
    assert content is None and calls[0].name == "get_weather"
    # no tools (tool_choice none, or none given): history only, no tool prompt
    assert [m["role"] for m in fallback_messages(_messages(HISTORY), None,
                                                 HermesToolParser)] == ["user", "assistant",
                                                                        "tool"]
