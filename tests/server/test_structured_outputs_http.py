"""Structured outputs over real HTTP with the official openai client, on
SmolLM2-135M-Instruct: OpenAI's response_format (json_schema, json_object), vLLM's
structured_outputs field and its legacy guided_* fields, on /v1/chat/completions and
/v1/completions. Sampled outputs (temperature 1) must satisfy their constraint (JSON
validated with `jsonschema`); bad constraints are a 400 naming the problem; nothing
recompiles after warm-up."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from server_harness import MODEL_NAME
from test_structured_outputs_engine import parse_expr

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Tokyo", "Lima"]},
    "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
    "required": ["name", "age", "city", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Invent a person: name, age, city and pets, as JSON."}]
EXPR = '''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] | [1-9] [0-9] | "(" expr ")"'''


@pytest.fixture(scope="module")
def server(smollm_server):
    return smollm_server        # tests/server/conftest.py (shared with other modules)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                         timeout=600)


def _json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def test_json_schema_16_samples_validate(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, n=16,
                                       temperature=1.0, max_tokens=64, seed=0,
                                       response_format=_json_schema_format())
    assert len(r.choices) == 16
    for c in r.choices:
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_schema_on_completions_streamed(client):
    prompt = "A person as JSON with name, age, city and pets:\n"
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(
            model=MODEL_NAME, prompt=prompt, n=2, temperature=1.0, max_tokens=64, seed=1,
            stream=True, extra_body={"response_format": _json_schema_format()}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == [0, 1]
    for i, t in texts.items():
        assert reasons[i] == "stop", (reasons[i], t)
        jsonschema.validate(json.loads(t), SCHEMA)


def test_json_object(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "Return JSON with the keys name and age "
                                              "for Tom, 3 years old."}],
        response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert isinstance(json.loads(c.message.content), dict)


def _together(*calls):
    """The calls' results, the calls sent at the same time: their rows share the
    engine's steps (a step costs about the same for a few rows as for one on a CPU)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_regex_and_choice(client):
    regex = r"(Mon|Tue|Wed) [0-9]{2}:[0-9]{2}"
    choices = ["positive", "negative", "neutral"]
    r, rc = _together(
        lambda: client.completions.create(
            model=MODEL_NAME, prompt="The meeting is on", n=4, temperature=1.0,
            max_tokens=16, seed=2, extra_body={"structured_outputs": {"regex": regex}}),
        lambda: client.chat.completions.create(
            model=MODEL_NAME, n=4, temperature=1.0, max_tokens=8, seed=3,
            messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
            extra_body={"guided_choice": choices}))
    for c in r.choices:
        assert re.fullmatch(regex, c.text), c.text
    for c in rc.choices:
        assert c.message.content in choices and c.finish_reason == "stop"


def test_grammars_parse(client):
    """An EBNF grammar (vLLM's structured_outputs.grammar) and a Lark one
    (guided_grammar): outputs parse with an independent parser."""
    lark = 'start: greeting " " NAME "!"\ngreeting: "hello" | "hi"\nNAME: /[A-Z][a-z]{1,8}/'
    r, rl = _together(
        lambda: client.chat.completions.create(
            model=MODEL_NAME, n=3, temperature=1.0, max_tokens=32, seed=4,
            messages=[{"role": "user", "content": "Write an arithmetic expression."}],
            extra_body={"structured_outputs": {"grammar": EXPR}}),
        lambda: client.completions.create(
            model=MODEL_NAME, prompt="Say hi to someone:", n=3, temperature=1.0,
            max_tokens=16, seed=5, extra_body={"guided_grammar": lark}))
    for c in r.choices:
        assert c.finish_reason == "stop" and parse_expr(c.message.content), c
    for c in rl.choices:
        assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}!", c.text), c.text


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "invalid JSON schema"),
    ({"guided_json": "{not json"}, "invalid JSON schema: not valid JSON"),
    ({"structured_outputs": {"regex": "([0-9]"}}, "invalid regex"),
    ({"guided_grammar": 'root ::= ("a" | missing'}, "invalid grammar"),
    ({"structured_outputs": {"grammar": "root ::= " + " | ".join(
        f'"w{i}"' for i in range(12_000))}}, "grammar too large"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "only one structured output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs json_schema.schema"),
])
def test_bad_constraints_are_400(client, body, needle):
    for call in (lambda: client.completions.create(model=MODEL_NAME, prompt="x",
                                                   max_tokens=4, extra_body=body),
                 lambda: client.chat.completions.create(
                     model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                     max_tokens=4, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400
        assert needle in e.value.message, e.value.message


def test_no_recompiles_after_warmup(server, client):
    """Every test above (constrained and not, n up to 16) ran on the warmed-up shapes."""
    client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8)
    assert server.engine.core.num_compiles == server.compiles_after_warmup


# ---- hostile constraints: bounded, off the engine thread and the event loop ----------------
def ref_dag(levels: int) -> dict:
    """$defs d_i = d_{i+1} or a list of d_{i+1}: 2^levels paths, a few KB of text."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"},
                                {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}]}
            for i in range(levels)}
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


DOUBLING_GBNF = ("root ::= a0\n" + "".join(f"a{i} ::= a{i + 1} a{i + 1}\n" for i in range(26))
                 + 'a26 ::= "x"')
CATASTROPHIC_REGEX = "(a|b)*a(a|b){24}"
ATTACKS = [   # (name, extra body, status, check of the text on 200 | the 400's message)
    ("reference DAG", {"response_format": _json_schema_format(ref_dag(30))}, 200,
     lambda t: re.fullmatch(r"[\[\]0-9, -]*", t)),
    ("doubling grammar", {"structured_outputs": {"grammar": DOUBLING_GBNF}}, 400,
     "invalid grammar"),
    ("catastrophic regex", {"guided_regex": CATASTROPHIC_REGEX}, 200,
     lambda t: re.fullmatch("[ab]*", t)),
    ("huge enum", {"guided_choice": [f"option {i:04d}" for i in range(1024)]}, 200,
     lambda t: re.fullmatch(r"(o(p(t(i(o(n( [0-9]{0,4})?)?)?)?)?)?)?", t)),
    ("huge alternation", {"guided_regex": "(" + "|".join(f"w{i}x" for i in range(3000))
                          + ")"}, 200, lambda t: re.fullmatch(r"(w[0-9]{0,4}x?)?", t)),
    # as a string: the body itself may nest only so deep
    ("deep nesting", {"guided_json": json.dumps(nested_arrays(300))}, 400,
     "invalid JSON schema"),
]


@pytest.mark.stall
@pytest.mark.parametrize("name,body,status,ok", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_hostile_constraint_stalls_nobody(server, name, body, status, ok):
    """Each hostile constraint gets its answer (a 400, or a constrained output) within
    a bound, while a concurrent stream keeps receiving tokens with no gap over 2 s and
    /health answers every probe within 1 s: the analysis runs in pools and a killable
    child process, never on the engine thread or the event loop."""
    from victim import Victim
    with Victim(server.url, MODEL_NAME) as v:
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "max_tokens": 12, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Answer."}], **body})
        took = time.monotonic() - t0
        time.sleep(0.5)         # the victim goes on after the attack's answer
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    assert took < 30, f"{name}: answered after {took:.1f} s"
    if status == 200:
        text = r.json()["choices"][0]["message"]["content"]
        assert ok(text), (name, text)
    else:
        assert ok in r.json()["error"]["message"], r.text
    v.check()
