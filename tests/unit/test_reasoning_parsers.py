"""Reasoning parsers (host only): <think>...</think> split from the answer, whole and
streamed in every split (one character at a time, and cut at every position), so a
tag that arrives in pieces is still found and never leaks into either part."""
from __future__ import annotations

import pytest

from jaxserve.server.chat_outputs import ChatOutputs
from jaxserve.server.formatting import Delta
from jaxserve.server.reasoning import (REASONING_PARSERS, DeepSeekR1ReasoningParser,
                                       Qwen3ReasoningParser, split_reasoning)

# (parser, output text, reasoning (None: no reasoning), content)
CASES = [
    (DeepSeekR1ReasoningParser, "Let me think.</think>\n\nParis.", "Let me think.", "Paris."),
    (DeepSeekR1ReasoningParser, "<think>hmm</think>Paris", "hmm", "Paris"),
    (DeepSeekR1ReasoningParser, "still thinking <", "still thinking <", ""),
    (DeepSeekR1ReasoningParser, "a < b </thinking> </think>x", "a < b </thinking> ", "x"),
    (DeepSeekR1ReasoningParser, "</think>", "", ""),
    (Qwen3ReasoningParser, "\n<think>\nabc\n</think>\n\n{\"a\": 1}", "\nabc\n", '{"a": 1}'),
    (Qwen3ReasoningParser, "Paris, no thinking.", None, "Paris, no thinking."),
    (Qwen3ReasoningParser, "I <think> not", None, "I <think> not"),
    (Qwen3ReasoningParser, "<thi", None, "<thi"),
    (Qwen3ReasoningParser, "<think>cut short", "cut short", ""),
]


def _stream(parser, pieces):
    r, c = [], []
    for p in pieces:
        d = parser.feed(p)
        r.append(d.reasoning)
        c.append(d.content)
    d = parser.finish()
    return r + [d.reasoning], c + [d.content]


@pytest.mark.parametrize("cls,text,reasoning,content", CASES)
def test_split_whole_and_streamed(cls, text, reasoning, content):
    assert split_reasoning(cls(), text) == (reasoning, content)
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]:
        p = cls()
        r, c = _stream(p, pieces)
        assert ("".join(r) if p.entered else None) == reasoning, pieces
        assert "".join(c) == content, pieces
        assert not any("</think>" in x for x in r + c if "</thinking>" not in x)


def test_registry_has_vllms_names():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}


def _delta(text, final=False, index=0):
    return Delta(index, text, 0, 0, "stop" if final else None, None, None)  # type: ignore


def test_chat_outputs_stream_reasoning_then_content():
    out = ChatOutputs(reasoning=DeepSeekR1ReasoningParser)
    pieces = ["Think", "ing </th", "ink>", " The answer", ""]
    deltas = [out.delta(_delta(p, i == len(pieces) - 1), i == 0)[0]
              for i, p in enumerate(pieces)]
    assert deltas[0] == {"role": "assistant", "reasoning_content": "Think"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Thinking "
    assert "".join(d.get("content", "") for d in deltas) == "The answer"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("content" not in d for d in deltas[:first_content])
    msg, _ = ChatOutputs(reasoning=DeepSeekR1ReasoningParser).message(
        _delta("".join(pieces), True))
    assert msg == {"role": "assistant", "content": "The answer",
                   "reasoning_content": "Thinking "}


def test_chat_outputs_echo_and_no_reasoning_left():
    msg, _ = ChatOutputs(reasoning=DeepSeekR1ReasoningParser).message(_delta("only", True))
    assert msg["content"] is None and msg["reasoning_content"] == "only"
    msg, _ = ChatOutputs(echo="The capital is").message(_delta(" Paris", True))
    assert msg == {"role": "assistant", "content": "The capital is Paris"}
    d, _ = ChatOutputs(echo="The capital is").delta(_delta(" Paris"), True)
    assert d == {"role": "assistant", "content": "The capital is Paris"}


def test_tags_that_are_special_tokens_are_kept_in_the_text():
    from types import SimpleNamespace

    from jaxserve.sampling.params import SamplingParams
    from jaxserve.server.reasoning import keep_tags
    special = SimpleNamespace(all_special_tokens=["<s>", "<think>", "</think>"])
    assert not keep_tags(SamplingParams(), special).skip_special_tokens
    assert keep_tags(SamplingParams(), SimpleNamespace(all_special_tokens=["<s>"])) \
        .skip_special_tokens
