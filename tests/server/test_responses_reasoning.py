"""POST /v1/responses on a server with --reasoning-parser (the whole app, in-process, on a
scripted engine: tests/support/scripted_engine.py), read with the official openai
client: the reasoning comes first as a `reasoning` item (reasoning_text content),
whole and streamed with the reasoning_text events before the message's, and the
`reasoning` request field is accepted."""
from __future__ import annotations

import openai
import pytest

from scripted_engine import ScriptedEngine, app_client, openai_client, word_tokenizer

THINKING = ["Let me ", "think.</th", "ink>\n\nThe ", "answer."]


TOK = word_tokenizer()
TOK.chat_template = ("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} "
                     "<|im_end|> {% endfor %}<|im_start|> assistant")


def _client(pieces, tokenizer=None, **args):
    engine = ScriptedEngine(pieces, tokenizer=tokenizer)
    return engine, openai_client(app_client(engine, TOK, **args))


def test_reasoning_item_comes_before_the_message():
    _, c = _client(THINKING, reasoning_parser="deepseek_r1")
    r = c.responses.create(model="m", input="w5", reasoning={"effort": "low"})
    assert [i.type for i in r.output] == ["reasoning", "message"]
    rs = r.output[0]
    assert rs.id.startswith("rs_") and rs.summary == [] and rs.status == "completed"
    assert [(p.type, p.text) for p in rs.content] == [("reasoning_text", "Let me think.")]
    assert r.output_text == "The answer."
    assert r.reasoning.effort == "low"             # echoed, as OpenAI does
    # given back as input (the SDK's output items), the reasoning item is accepted
    again = c.responses.create(model="m", input=[*[i.model_dump(exclude_none=True)
                                                   for i in r.output],
                                                 {"role": "user", "content": "w6"}])
    assert again.output_text == "The answer."


def test_no_reasoning_item_without_a_parser_or_without_reasoning():
    _, plain = _client(THINKING)
    r = plain.responses.create(model="m", input="w5")
    assert [i.type for i in r.output] == ["message"]
    assert r.output_text == "Let me think.</think>\n\nThe answer."
    _, qwen = _client(["w9 ", "w10"], reasoning_parser="qwen3")
    assert [i.type for i in qwen.responses.create(model="m", input="w5").output] == [
        "message"]


def test_streamed_reasoning_events_then_the_message():
    _, c = _client(THINKING, reasoning_parser="deepseek_r1")
    with c.responses.stream(model="m", input="w5") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first_msg = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_msg
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Let me think." and not any("</th" in d for d in deltas)
    added = [e for e in events if e.type == "response.content_part.added"]
    assert [p.part.type for p in added] == ["reasoning_text", "output_text"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning", "message"]
    assert done[0].content[0].text == "Let me think." and done[0].status == "completed"
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].id == done[0].id and final.output_text == "The answer."


def test_all_reasoning_and_no_answer():
    _, c = _client(["still ", "thinking"], reasoning_parser="deepseek_r1")
    r = c.responses.create(model="m", input="w5")
    assert [i.type for i in r.output] == ["reasoning"] and r.output_text == ""
    with c.responses.stream(model="m", input="w5") as stream:
        final = stream.get_final_response()
    assert final.output[0].content[0].text == "still thinking" and len(final.output) == 1


def test_a_bad_reasoning_effort_is_a_400_naming_it():
    _, c = _client(["w9"], reasoning_parser="qwen3")
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="w5", reasoning={"effort": "lots"})
    assert "reasoning" in str(e.value)


@pytest.mark.parametrize("pieces,parser,count", [
    (["<think>", "w5 w6", "</think>", "w9 w10"], "deepseek_r1", 4),
    (["w5 w6", "</think>", "w9 w10"], "deepseek_r1", 3),
    (["w5 ", "w6 w7"], "deepseek_r1", 3),        # never closed: all of it
    (["w9 ", "w10"], "qwen3", 0),
    (["<think>", "w5 w6", "</think>", "w9 w10"], None, 0)])
def test_usage_counts_the_reasoning_tokens(pieces, parser, count):
    """output_tokens_details.reasoning_tokens: the output tokens up to and including
    </think> (each piece is the tokens its words encode to), whole and streamed."""
    args = {"reasoning_parser": parser} if parser else {}
    _, c = _client(pieces, TOK, **args)
    total = sum(len(TOK.encode(p, add_special_tokens=False)) for p in pieces)
    r = c.responses.create(model="m", input="w5")
    with c.responses.stream(model="m", input="w5") as stream:
        final = stream.get_final_response()
    for u in (r.usage, final.usage):
        assert u.output_tokens == total
        assert u.output_tokens_details.reasoning_tokens == count
