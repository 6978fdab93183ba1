"""Structured outputs through the engine (host path) on SmolLM2-135M-Instruct: sampled
outputs (temperature 1) satisfy their regex / choice / schema / grammar, with a KV pool
small enough that requests are preempted and recomputed; asynchronous scheduling on and
off give the same tokens; unconstrained requests are unaffected; nothing recompiles after
warm-up."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve.sampling.params import SamplingParams

# these tests count compiles after warm-up: their engines warm up at start
pytestmark = pytest.mark.warmup

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and "
                                   "favourite color."}]
COLORS = ["red", "green", "blue", "yellow"]
REGEX = r"[A-Z][a-z]{2,8} [0-9]{2}"


@pytest.fixture(scope="module")
def llm():
    from jaxserve.frontend.llm import LLM
    # 8 blocks of 16 tokens: eight requests of ~45-token prompts and up to 48 output
    # tokens cannot all stay resident, so the scheduler preempts (and later recomputes)
    # some of them
    m = LLM(None, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
            token_buckets=[8, 128], block_size=16, num_kv_blocks=8)
    if getattr(m.engine, "device_structured", None) is not None:
        m.engine.device_structured = None      # this file tests the host path
    return m


def _ask(i):
    """Distinct prompts (no shared prefix blocks beyond the system prompt)."""
    return [{"role": "user", "content": f"{ASK[0]['content']} Person number {i}."}]


def _params(so, seed, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 48),
                          structured_outputs=so, **kw)


def test_constrained_outputs_valid_under_preemption(llm):
    before = llm.engine.scheduler.num_preemptions
    compiles = llm.num_compiles
    convs = [_ask(i) for i in range(4)] + [[{"role": "user", "content": "Name a color."}]] * 2 + \
        [[{"role": "user", "content": "Write a first name and a two-digit number."}]] * 2
    params = [_params({"json": SCHEMA}, s) for s in range(4)] + \
        [_params({"choice": COLORS}, s) for s in range(2)] + \
        [_params({"regex": REGEX}, s) for s in range(2)]
    outs = _chat_many(llm, convs, params)
    for o in outs[:4]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        value = json.loads(c.text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])     # the schema's order
    for o in outs[4:6]:
        assert o.outputs[0].text in COLORS and o.outputs[0].finish_reason == "stop"
    for o in outs[6:]:
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text
    assert llm.engine.scheduler.num_preemptions > before, "the pool was meant to preempt"
    assert llm.num_compiles == compiles, "recompiled after warm-up"


def _chat_many(llm, convs, params):
    prompts = [{"prompt_token_ids": llm.apply_chat_template(c)} for c in convs]
    return llm.generate(prompts, params, use_tqdm=False)


def test_grammar_output_parses(llm):
    grammar = '''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] | [1-9] [0-9] | "(" expr ")"'''
    conv = [{"role": "user", "content": "Write an arithmetic expression."}]
    outs = _chat_many(llm, [conv] * 3, [_params({"grammar": grammar}, s, max_tokens=40)
                                        for s in range(3)])
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert parse_expr(c.text), c.text
        else:               # cut by max_tokens: still a prefix the grammar allows
            assert re.fullmatch(r"[0-9+\-*/()]*", c.text), c.text


def parse_expr(s: str) -> bool:
    """Recursive descent for the grammar above: True iff s is a whole expression."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[1-9][0-9]|[0-9]", s[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def chain(item, ops) -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(s) and s[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")
    return expr() and pos == len(s)


def test_async_on_and_off_same_tokens(llm):
    convs = [ASK, [{"role": "user", "content": "Tell me a story."}], ASK]
    params = [_params({"json": SCHEMA}, 11), SamplingParams(temperature=1.0, seed=5,
                                                             max_tokens=24),
              _params({"regex": REGEX}, 12)]
    core = llm.engine
    saved = core.step
    try:
        core.step = core.step_async
        on = [o.outputs[0].token_ids for o in _chat_many(llm, convs, params)]
        core.step = core.step_pipelined
        off = [o.outputs[0].token_ids for o in _chat_many(llm, convs, params)]
    finally:
        core.step = saved
    assert on == off


def test_unconstrained_request_unaffected(llm):
    """A seeded unconstrained request draws the same tokens alone and next to
    constrained ones (the mask rows of others do not touch it)."""
    story = [{"role": "user", "content": "Tell me a story."}]
    plain = SamplingParams(temperature=1.0, seed=7, max_tokens=20)
    alone = _chat_many(llm, [story], [plain])[0].outputs[0].token_ids
    mixed = _chat_many(llm, [ASK, story, ASK], [_params({"json": SCHEMA}, 1), plain,
                                                _params({"json_object": True}, 2)])
    assert mixed[1].outputs[0].token_ids == alone


def test_eos_only_when_complete_and_bad_constraint_refused(llm):
    """A constraint the grammar can never finish within max_tokens is cut by length
    (EOS was never allowed early); a bad regex is refused at intake."""
    out = _chat_many(llm, [ASK], [_params({"regex": "[a-z]{200}"}, 3, max_tokens=8)])[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and re.fullmatch("[a-z]+", c.text), c
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate("x", _params({"regex": "(unclosed"}, 1))


def test_failed_compile_fails_that_request_alone(llm):
    """A grammar whose compile fails (here: made to fail) ends its request with the
    reason; a request next to it is served."""
    from jaxserve.structured.backend import GrammarError
    backend = llm.engine.scheduler.grammar.backend
    real = backend._compile

    def failing(kind, text):
        if "zzz" in text:
            raise GrammarError("the regex constraint cannot be compiled: too complex (test)")
        return real(kind, text)
    backend._compile = failing
    try:
        outs = _chat_many(llm, [ASK, ASK], [_params({"regex": "zzz+q"}, 1, max_tokens=8),
                                            SamplingParams(temperature=0, max_tokens=6)])
    finally:
        del backend._compile
    assert outs[0].error is not None and "too complex (test)" in outs[0].error
    assert outs[0].outputs[0].token_ids == []
    assert len(outs[1].outputs[0].token_ids) == 6 and outs[1].error is None


def test_abort_while_compiling(llm):
    """An aborted request leaves WAITING_FOR_FSM and the engine forgets it."""
    gate = llm.engine.scheduler.grammar
    rid = llm.add_request("x", _params({"regex": "abort-me+"}, 1, max_tokens=4))
    cid = f"{rid}-0"
    assert cid in gate.compiling
    llm.engine.abort_requests([cid])
    llm.processor.abort(rid)
    assert cid not in gate.compiling and cid not in gate.grammars
    assert llm.engine.scheduler.get_request(cid) is None
    assert not llm.engine.has_unfinished_requests()
