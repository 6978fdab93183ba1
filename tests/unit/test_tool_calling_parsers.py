"""Tool-call parsers (host only): hermes and llama3_json read the calls a model writes,
the constrained parsers read the JSON a grammar enforced. Every case is parsed whole
and streamed (one character at a time, and split at every position): the calls and
the content must come out the same, and no content piece may leak part of a call."""
from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.server.tool_parsers import (HermesToolParser, Llama3JsonToolParser,
                                          NamedFunctionParser, RequiredCallsParser,
                                          merge_calls, parse_all, required_schema)

W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
T = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (text, expected content, expected [(name, arguments dict)])
HERMES = [
    ("The weather is nice.", "The weather is nice.", []),
    (f"<tool_call>\n{W}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "days": 2})]),
    (f"Let me check.\n<tool_call>\n{W}\n</tool_call>", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 2})]),
    (f"<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>", None,
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "Europe/Paris"})]),
    # unclosed at the very end (the model stopped on EOS): still a call
    (f"<tool_call>\n{W}\n", None, [("get_weather", {"city": "Paris", "days": 2})]),
    # a call that started as one stays a call (its arguments were streamed already),
    # its malformed arguments as the model wrote them; the next call is still read
    ('<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> then '
     f"<tool_call>{T}</tool_call>", "then",
     [("get_weather", '{"city": }'), ("get_time", {"tz": "Europe/Paris"})]),
    # not a call at all stays content, verbatim
    ('<tool_call>{"nome": "x"}</tool_call> ok', '<tool_call>{"nome": "x"}</tool_call> ok', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
     []),
    ("<tool_call>not json", "<tool_call>not json", []),
    # a partial tag at the end is content once the text ends
    ("a < b and x <tool", "a < b and x <tool", []),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool"}}</tool_call>', None,
     [("f", {"s": "</tool"})]),
    ('<tool_call>{"name": "no_args"}</tool_call>', None, [("no_args", {})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>', None,
     [("f", {"k": 1})]),
]

LLAMA = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('  {"name": "a", "parameters": {"x": [1, {"y": "}"}]}}; {"name": "b", "arguments": {}}',
     None, [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    ("Paris is sunny today.", "Paris is sunny today.", []),
    ('I will call {"name": "a", "parameters": {}}',
     'I will call {"name": "a", "parameters": {}}', []),
    ('{"name": "a", "parameters": {"x": oops}}', None, [("a", '{"x": oops}')]),
    ('{"name": "a" "parameters": {}}', '{"name": "a" "parameters": {}}', []),
    ('{"name": "a", "parameters": {}} and then prose', "and then prose", [("a", {})]),
    ('{"name": "a", "parameters": {"x": 1', None, [("a", '{"x": 1')]),    # cut short
    ("<|python", "<|python", []),
]


def _expected(calls):
    return [(n, a) for n, a in calls]


def _loaded(arguments):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments        # malformed: the model's text as it is


def _got(deltas):
    return [(c.name, _loaded(c.arguments)) for c in merge_calls(deltas)]


def _stream(parser, pieces):
    content, deltas = [], []
    for p in pieces:
        r = parser.feed(p)
        content.append(r.content)
        deltas += r.calls
    r = parser.finish()
    content.append(r.content)
    return content, deltas + r.calls


def _check(make, text, content, calls, tag):
    got_content, got_calls = parse_all(make(), text)
    assert got_content == content
    assert _got(got_calls) == _expected(calls)
    splits = [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in splits:
        pieces_out, deltas = _stream(make(), pieces)
        assert ("".join(pieces_out) or None) == content, pieces
        assert _got(deltas) == _expected(calls), pieces
        ids = [d.id for d in merge_calls(deltas)]
        assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
        if calls and tag and tag not in (content or ""):    # held back: no piece of a
            # call reaches the content
            assert all(tag not in p and not p.endswith(("<", "<tool")) for p in pieces_out
                       if p), pieces_out


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes(text, content, calls):
    _check(HermesToolParser, text, content, calls, "<tool_call>")


@pytest.mark.parametrize("text,content,calls", LLAMA)
def test_llama3_json(text, content, calls):
    _check(Llama3JsonToolParser, text, content, calls, None)


def test_streamed_hermes_sends_content_before_the_call_and_each_call_once():
    p = HermesToolParser()
    assert p.feed("Checking ").content == "Checking"
    assert p.feed("<tool_").content == ""          # may be the tag: held back
    r = p.feed(f"call>{W}</tool_call>")
    assert r.content == "" and [c.name for c in r.calls] == ["get_weather", None]
    first = r.calls[0]
    # OpenAI's first delta of a call: id, type, name and no arguments yet
    assert first.openai() == {"index": 0, "id": first.id, "type": "function", "function": {
        "name": "get_weather", "arguments": ""}}
    assert r.calls[1].openai() == {"index": 0, "function": {
        "arguments": json.dumps(json.loads(W)["arguments"])}}
    r = p.feed(f" and <tool_call>{T}</tool_call>")
    # whitespace next to a call is not content
    assert r.content == "and" and [c.index for c in r.calls] == [1, 1]
    assert p.finish().content == ""


TOOLS = [
    {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "get_time"},      # no parameters
]


def test_required_schema_accepts_exactly_calls_of_the_tools():
    schema = required_schema(TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}},
          {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"days": 3}}],
                [{"name": "get_weather", "parameters": {"city": "P", "days": 0}}],
                [{"name": "other", "parameters": {}}], [{"name": "get_time"}],
                {"name": "get_time", "parameters": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_parser_reads_each_call_whole_in_any_pieces():
    text = ('[{"name": "get_weather", "parameters": {"city": "Pa]ris", "days": 3}}, '
            '{"name": "get_time", "parameters": {}}]')
    calls = [("get_weather", {"city": "Pa]ris", "days": 3}), ("get_time", {})]
    assert _got(parse_all(RequiredCallsParser(), text)[1]) == calls
    assert parse_all(RequiredCallsParser(), text)[0] is None
    for i in range(1, len(text)):
        content, deltas = _stream(RequiredCallsParser(), [text[:i], text[i:]])
        assert _got(deltas) == calls and "".join(content) == ""
    # cut short by max_tokens: the complete call is kept
    cut = text.index("}}, ") + 8
    assert _got(parse_all(RequiredCallsParser(), text[:cut])[1]) == calls[:1]
    # not an array of calls at all: content
    assert parse_all(RequiredCallsParser(), "sorry, no") == ("sorry, no", [])


def test_named_parser_streams_the_arguments_of_one_call():
    text = ' {"city": "Paris", "days": 2}'
    content, deltas = _stream(NamedFunctionParser("get_weather"), list(text))
    assert "".join(content) == ""
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    assert all(d.name is None and d.index == 0 for d in deltas[1:])
    (call,) = merge_calls(deltas)
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}


LONG = '{"city": "' + "Llanfairpwllgwyngyll " * 4 + '", "days": 3}'
STREAMED = [  # (parser, text before the arguments, after them)
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": ', "}"),
    (RequiredCallsParser, '[{"name": "get_weather", "parameters": ', "}]"),
]


@pytest.mark.parametrize("make,head,tail", STREAMED, ids=lambda v: getattr(v, "__name__", ""))
def test_arguments_stream_as_they_are_generated(make, head, tail):
    """OpenAI's shape: the call's first delta has its id and name and arguments "",
    then each piece of generated arguments comes in its own delta, not at the end."""
    p, deltas, seen_at = make(), [], []
    text = head + LONG + tail
    for i in range(0, len(text), 5):           # five characters per generated token
        got = p.feed(text[i:i + 5]).calls
        deltas += got
        seen_at += [i] * len(got)
    deltas += p.finish().calls
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    assert deltas[0].id.startswith("call_")
    fragments = [d.arguments for d in deltas[1:]]
    assert all(d.name is None and d.index == 0 for d in deltas[1:])
    assert len(fragments) > 10 and "".join(fragments) == LONG
    # the first fragment arrives right after the header, long before the call ends
    assert seen_at[1] <= len(head) + 5 < len(text) - 20
