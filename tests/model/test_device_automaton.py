"""The on-device structured-outputs automaton: tables, pool and in-step ops.

Truths: outlines-core's own Index and Guide (allowed tokens and transitions along
random walks), Python's `re` (what a walk that ends in a final state spells), a
JSON-schema validator, and the host copy of the tables for the jitted device ops.
Vocabulary: the embedded model's real byte-level BPE tokenizer (SmolLM2, 49152 ids).
"""
from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import outlines_core
import pytest

from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
from jaxserve.model.loader.default_model import default_gguf_path
from jaxserve.sampling.bitmask import mask_logits
from jaxserve.sampling.params import StructuredOutputsParams as SO
from jaxserve.structured import device_pool, device_step
from jaxserve.structured.device_automaton import (AutomatonLimits, NotOnDevice, compile_tables,
                                                  device_regex, tables_from_index)
from jaxserve.structured.device_compiler import DeviceCompiler, DeviceStructured
from jaxserve.structured.device_vocab import TokenVocabulary
from jaxserve.structured.range_alloc import RangeAllocator

V = 49152
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "ok", "color"]}
REGEXES = [r"[0-9]{1,3}(\.[0-9]{1,3}){3}", r"(cat|dog)s? (are|is) [a-z ]{0,12}!",
           r"(ça|über|\d+) [a-zé-]{1,6}"]


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocabulary.from_tokenizer(tok, (tok.eos_token_id,), V)


def test_token_bytes_decode_like_the_tokenizer(tok, vocab):
    """Each token's bytes are what the tokenizer decodes it to (byte-level BPE's
    stand-in characters undone); special tokens are left out."""
    rng = random.Random(0)
    ids = rng.sample(sorted(vocab.token_bytes), 400)
    for i in ids:
        b = vocab.token_bytes[i]
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue        # a partial UTF-8 token: decode() would print U+FFFD
        assert tok.decode([i]) == text, i
    assert tok.eos_token_id not in vocab.token_bytes
    for i in tok.all_special_ids:
        assert i not in vocab.token_bytes
    # several tokens of one text are joined as in the tokenizer
    text = "Hello, wörld! {\"a\": 12}\n"
    assert b"".join(vocab.token_bytes[i] for i in tok.encode(text, add_special_tokens=False)) \
        == text.encode()


def _walks(index, tables, eos, rng, n_walks, max_len):
    """Random walks over outlines-core's Index: at each step the device tables must
    allow exactly the Index's tokens (EOS only in final states) and lead to the
    corresponding state; returns the walks that ended in a final state."""
    init = index.get_initial_state()
    finished = []
    for _ in range(n_walks):
        s_o, s_t, walk = init, 0, []
        guide = outlines_core.Guide(index)
        for _ in range(max_len):
            want = set(index.get_allowed_tokens(s_o)) - {eos}
            if index.is_final_state(s_o):
                want.add(eos)
            assert set(tables.allowed(s_t).tolist()) == want
            assert set(guide.get_tokens()) == set(index.get_allowed_tokens(s_o))
            assert bool(tables.final[s_t]) == index.is_final_state(s_o)
            choices = sorted(want - {eos})
            if not choices or (index.is_final_state(s_o) and rng.random() < 0.15):
                finished.append(walk)
                assert tables.next_state(s_t, eos) == s_t     # EOS leaves the state as is
                break
            t = rng.choice(choices)
            s_o, s_t = index.get_next_state(s_o, t), tables.next_state(s_t, t)
            guide.advance(t, return_tokens=False)
            walk.append(t)
    return finished


@pytest.mark.parametrize("kind", ["regex0", "regex1", "regex2", "choice", "json"])
def test_tables_match_outlines_index(kind, vocab):
    so = {"regex0": SO(regex=REGEXES[0]), "regex1": SO(regex=REGEXES[1]),
          "regex2": SO(regex=REGEXES[2]),
          "choice": SO(choice=["yes", "no", "a (b) c?", "ä.*"]), "json": SO(json=SCHEMA)}[kind]
    regex = device_regex(so)
    index = outlines_core.Index(regex, vocab.outlines())
    tables = tables_from_index(index, vocab)
    trans = index.get_transitions()
    assert tables.num_states == len(set(trans) | set(index.get_final_states()))
    # per state: the mask words, 256 byte transitions and the exception run's start
    # and length (a dense next-state table would be V * 4 bytes: 27x more)
    assert tables.nbytes == tables.num_states * (V // 32 + 258) * 4 + 8 * tables.num_exceptions
    assert tables.num_exceptions < 0.01 * len(tables.exc_start) * 256
    finished = _walks(index, tables, vocab.eos_token_ids[0], random.Random(1), 60, 80)
    assert finished, "no walk reached a final state"
    for walk in finished:
        text = b"".join(vocab.token_bytes[t] for t in walk).decode("utf-8")
        assert tables.final[tables.walk(walk)]
        if kind == "json":
            doc = json.loads(text)
            assert set(doc) == {"name", "ok", "color"} and doc["color"] in ("red", "green",
                                                                            "blue")
            assert len(doc["name"]) <= 6 and isinstance(doc["ok"], bool)
        elif kind == "choice":
            assert text in so.choice
        else:
            assert re.fullmatch(regex, text), text


def test_not_on_device():
    with pytest.raises(NotOnDevice):
        device_regex(SO(json_object=True))
    with pytest.raises(NotOnDevice):
        device_regex(SO(grammar='root ::= "a"'))
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    with pytest.raises(NotOnDevice, match="recursive"):
        device_regex(SO(json=tree))
    flat = {"$defs": {"leaf": {"type": "integer"}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/leaf"},
                                             "b": {"$ref": "#/$defs/leaf"}}}
    assert device_regex(SO(json=flat))      # a shared, non-recursive $ref is fine


def test_choice_escapes_metacharacters(vocab):
    """Choices are literals: '.', '*', '(' and spaces match only themselves."""
    tables = compile_tables(device_regex(SO(choice=["a.b", "x*", "(c d)"])), vocab)
    spell = lambda s: [i for i, b in vocab.token_bytes.items() if b == s.encode()]  # noqa: E731
    state = 0
    for ch in "a.b":
        (t,) = spell(ch)[:1]
        assert t in tables.allowed(state)
        state = tables.next_state(state, t)
    assert tables.final[state]
    assert spell("c")[0] not in tables.allowed(tables.next_state(0, spell("a")[0]))


def test_limits_send_big_tables_to_the_host(vocab):
    with pytest.raises(NotOnDevice, match="states"):
        compile_tables(r"[a-z]{40}", vocab, AutomatonLimits(max_states=16))
    with pytest.raises(NotOnDevice):
        compile_tables(r"(", vocab)


def test_compile_wait_is_bounded_then_the_cache_serves(vocab):
    """Admission waits at most wait_s for a new constraint (then the host path takes
    the request); the compile goes on, and later requests get its tables at once."""
    c = DeviceCompiler(lambda: vocab)
    so = SO(regex=r"[a-z]{1,30}@[a-z]{1,30}\.(com|org)")
    with pytest.raises(NotOnDevice, match="still compiling"):
        c.compile(so, wait_s=0.0)
    key, tables = c.compile(so, wait_s=None)           # the same job, waited for
    assert c.compile(SO(regex=key), wait_s=0.0)[1] is tables
    with pytest.raises(NotOnDevice):
        c.compile(SO(json='{"type": "object", '), wait_s=0.0)   # not JSON: host path says so
    c.shutdown()


def test_gate_decision_is_asynchronous(vocab):
    """With the host path's gate: start() compiles in the background, decide() says
    'not yet' (None) while it runs, then attaches the tables (True); past wait_s, or
    for a constraint that is not regular, the host path keeps the request (False)."""
    auto = device_pool.DeviceAutomata(4, V, max_states=256)
    dev = DeviceStructured(DeviceCompiler(lambda: vocab), auto, wait_s=60.0)
    req = lambda rid, so: SimpleNamespace(  # noqa: E731
        request_id=rid, sampling_params=SimpleNamespace(structured_outputs=so))
    a = req("a", SO(regex=r"[a-z]{1,30}#[0-9]{2}"))
    dev.start(a, now=0.0)
    assert dev.decide(a, now=0.0) is None and dev.futures()
    dev.futures()[0].result()
    assert dev.decide(a, now=1.0) is True and "a" in auto._req_key
    b = req("b", SO(regex=r"[A-Z]{1,30}%[0-9]{3}"))
    dev.start(b, now=0.0)
    assert dev.decide(b, now=61.0) is False and "still compiling" in dev.last_fallback
    c = req("c", SO(json_object=True))
    dev.start(c)
    assert dev.decide(c, now=0.0) is False and "not regular" in dev.last_fallback
    dev.compiler.shutdown()


def test_range_allocator_first_fit_and_merge():
    a = RangeAllocator(10)
    assert [a.alloc(3), a.alloc(3), a.alloc(3)] == [0, 3, 6]
    assert a.alloc(2) is None
    a.free(3, 3)
    assert a.alloc(4) is None
    a.free(0, 3)                                  # merges with [3, 6)
    assert a.alloc(5) == 0 and a.num_free == 2
    a.free(0, 5)
    a.free(6, 3)
    assert a.num_free == 10 and a.alloc(10) == 0
    a.free(0, 10)
    with pytest.raises(AssertionError, match="double free"):
        a.free(2, 1)


# ---- device ops vs the host tables -----------------------------------------------------
def _pick(rng, t, s, allowed, eos):
    """A token to feed: often one of the state's exceptions (rare under a uniform
    choice), else any allowed token but EOS."""
    exc = t.exc_tokens[t.exc_start[s]:t.exc_start[s] + t.exc_len[s]]
    if len(exc) and rng.random() < 0.5:
        return int(rng.choice(exc))
    non_eos = allowed[allowed != eos]
    return int(rng.choice(non_eos if len(non_eos) else allowed))


def test_device_mask_and_advance_follow_the_host_tables(vocab):
    """Three constraints in one pool (one shared by two slots; one with exceptions to
    the byte walk), an unconstrained slot and a padding row: the jitted mask + advance
    give each row exactly the host tables' allowed tokens and next states along random
    walks, ANDed with the host path's words where given."""
    t_json = compile_tables(device_regex(SO(json=SCHEMA)), vocab)
    t_re = compile_tables(REGEXES[0], vocab)
    t_dig = compile_tables(r"\d+", vocab)           # Unicode digits: exceptions
    assert t_dig.num_exceptions > 0
    total = t_json.num_states + t_re.num_states + t_dig.num_states
    auto = device_pool.DeviceAutomata(7, V, max_states=total, max_exceptions=256)
    pool = auto.warmup(auto.init_pool(), 6)
    assert auto.attach("a", "json", t_json) and auto.attach("b", "re", t_re)
    assert auto.attach("c", "json", t_json)       # shares a's copy
    assert auto.attach("e", "dig", t_dig)
    pool = auto.start_slot(pool, 0, "a", [])
    pool = auto.start_slot(pool, 2, "b", [])
    first = [int(t_json.allowed(0)[0])]
    pool = auto.start_slot(pool, 3, "c", first)    # resumed: replays its kept output
    pool = auto.start_slot(pool, 4, "e", [])
    pool = auto.start_slot(pool, 1, "u", [])       # unconstrained
    slots = jnp.array([0, 1, 2, 3, 4, 6], jnp.int32)
    valid = jnp.array([True] * 5 + [False])
    # the host path's words for the step: row 2 (slot 2) also may not use even ids
    host_words = np.full((6, V // 32), -1, np.int32)
    host_words[2] = np.int32(-1431655766)          # 0xAAAAAAAA: odd bits only

    @jax.jit
    def step(pool, logits, tokens):
        words = device_step.row_words(pool, slots, jnp.asarray(host_words))
        masked = mask_logits(logits, words, branch=True)     # as the sampler applies it
        return masked, device_step.advance(pool, slots, tokens, valid)

    host = {0: (t_json, 0), 2: (t_re, 0), 3: (t_json, t_json.walk(first)), 4: (t_dig, 0)}
    rng = np.random.default_rng(0)
    eos = vocab.eos_token_ids[0]
    for _ in range(14):
        tokens = np.zeros(6, np.int32)
        for r in range(5):
            if r in host:
                t, s = host[r]
                allowed = t.allowed(s)
                odd = allowed[allowed % 2 == 1]
                if r == 2 and len(odd):         # (else: any token of the constraint)
                    allowed = odd
                tokens[r] = _pick(rng, t, s, allowed, eos)
            else:
                tokens[r] = rng.integers(V)
        masked, pool = step(pool, jnp.zeros((6, V), jnp.float32), jnp.asarray(tokens))
        finite = np.isfinite(np.asarray(masked))
        for r in range(5):
            if r in host:
                t, s = host[r]
                want = t.allowed(s)
                want = want[want % 2 == 1] if r == 2 else want
                assert np.array_equal(np.nonzero(finite[r])[0], want)
                host[r] = (t, t.next_state(s, int(tokens[r])))
            else:
                assert finite[r].all()
        assert finite[5].all()                     # padding row: unconstrained
    got = np.asarray(pool.slot_state)
    bases = {k: e.base for k, e in auto._entries.items()}
    assert got[0] == bases["json"] + host[0][1] and got[3] == bases["json"] + host[3][1]
    assert got[2] == bases["re"] + host[2][1] and got[4] == bases["dig"] + host[4][1]
    assert got[1] == -1 and got[6] == -1
    # the pool is full: another constraint waits for space (host path) while these are
    # in use, and evicts them (least recently used first) once they are not
    big = compile_tables(r"[a-z]{%d}" % (total - 1), vocab, AutomatonLimits(max_states=total))
    assert big.num_states == total
    assert not auto.attach("d", "big", big)
    for r in "abce":
        auto.detach(r)
    assert auto.attach("d", "big", big)
    assert set(auto._entries) == {"big"}


def test_without_outlines_core_the_host_path_takes_everything(vocab, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "outlines_core", None)     # import fails
    with pytest.raises(NotOnDevice, match="not installed"):
        compile_tables("[ab]+", vocab)
    with pytest.raises(NotOnDevice, match="not installed"):
        device_regex(SO(json=SCHEMA))
