"""Structured outputs on the device path, end to end through jaxserve.LLM.

A tiny random model over the embedded model's real tokenizer (49152 byte-level BPE
ids) samples at temperature 1.0: close to a random walk over the allowed tokens, so
the automaton alone keeps the output valid. Truths: Python's `re`, the choice list,
a JSON-schema validator (jsonschema); the same engine in the other scheduling
orders; the same engine without preemption.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_utils import tiny_config, tiny_weights
from jaxserve import SamplingParams as SP
from jaxserve.frontend.llm import LLM
from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
from jaxserve.model.loader.default_model import default_gguf_path
from jaxserve.sampling.params import StructuredOutputsParams as SO
from jaxserve.structured import device_pool

# these tests count compiles after warm-up: their engines warm up at start
pytestmark = pytest.mark.warmup

SMALL = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
             token_buckets=[16, 64])
IP = r"[0-9]{1,3}(\.[0-9]{1,3}){3}"
CHOICES = ["yes", "no", "not sure", "ça va"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2}},
          "required": ["name", "ok", "color"]}
PROMPTS = ["Give me an address:", "Answer yes or no.", "JSON please", "hello"]


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def model(tok):
    cfg = tiny_config(vocab_size=49152, eos_token_ids=(tok.eos_token_id,))
    return cfg, tiny_weights(cfg)


def _make(model, tok, tables_of=None, **kw):
    """tables_of: an engine whose device compiler this one takes over (the same model
    and tokenizer, so the same tables): a constraint's tables are compiled once per
    module, in one child process, not again for every engine a test compares."""
    cfg, w = model
    llm = LLM.from_weights(cfg, w, tok, **{**SMALL, **kw})
    dev = llm.engine.device_structured
    if tables_of is not None:
        dev.compiler.shutdown()         # never used: no child started
        dev.compiler = tables_of.engine.device_structured.compiler
    # a loaded test machine may take longer than the 5 s admission wait to compile the
    # tables (or to start it while another compiles); these tests are about the device
    # path, so wait for them
    dev.wait_s = 120.0
    dev.queued_grace_s = 120.0
    return llm


@pytest.fixture(scope="module")
def llm(model, tok):
    return _make(model, tok)


def _params(kind: str, i: int, temperature: float = 1.0) -> SP:
    so = {"regex": SO(regex=IP), "choice": SO(choice=CHOICES), "json": SO(json=SCHEMA)}[kind]
    return SP(max_tokens=120, temperature=temperature, seed=100 + i, structured_outputs=so)


def _check(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(IP, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


def _texts(llm, kinds, temperature=1.0, n=16):
    params = [_params(k, i, temperature) for i, k in enumerate(kinds * n)]
    llm.engine.device_structured.last_fallback = None
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    assert llm.engine.device_structured.last_fallback is None     # all on the device
    return [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids)
            for o in outs]


def test_outputs_follow_their_constraint(llm):
    """16 requests of each kind, batched together with unconstrained ones, at
    temperature 1.0: every output stops by itself and is valid; the unconstrained
    rows get the tokens they get when run alone (seeded)."""
    kinds = ["regex", "choice", "json"]
    params = [_params(k, i) for i, k in enumerate(kinds * 16)]
    free = [SP(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params) + 4)], params + free,
                        use_tqdm=False)
    for i, o in enumerate(outs[:48]):
        assert o.outputs[0].finish_reason == "stop", (kinds[i % 3], o.outputs[0].text)
        _check(kinds[i % 3], o.outputs[0].text)
    assert len({o.outputs[0].text for o in outs[:48]}) > 20      # really sampled
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[48:]] == \
        [o.outputs[0].token_ids for o in alone]


def test_same_outputs_in_every_scheduling_order(model, tok, llm):
    """Seeded requests give the same tokens with asynchronous scheduling (the next
    step dispatched before this one's tokens reach the host: the automaton state
    advances on the device), pipelined, and strictly in turn."""
    kinds = ["json", "regex", "choice"]
    runner, fed = llm.engine.runner, []

    def spy(so):             # tokens the step reads on the device (not yet on the host)
        step = type(runner).dispatch(runner, so)
        fed.append(int((step.batch.feed >= 0).sum()))
        return step
    runner.dispatch = spy
    try:
        got = {"async": _texts(llm, kinds, n=3)}
    finally:
        del runner.dispatch
    assert sum(fed) > 0, "constrained requests did not run ahead of the host"
    for order, kw in {"pipelined": dict(async_scheduling=False),
                      "in turn": dict(pipeline_steps=False)}.items():
        got[order] = _texts(_make(model, tok, tables_of=llm, **kw), kinds, n=3)
    assert got["async"] == got["pipelined"] == got["in turn"]
    for (text, reason, _), kind in zip(got["async"], kinds * 3):
        assert reason == "stop"
        _check(kind, text)


def test_preemption_replays_the_kept_tokens(model, tok, llm):
    """With too few KV blocks the scheduler preempts; a resumed request's automaton
    state is rebuilt from the tokens it kept (host replay). Greedy outputs equal the
    unpreempted engine's; sampled ones stay valid."""
    small = _make(model, tok, tables_of=llm, num_kv_blocks=10, max_model_len=160,
                  max_num_batched_tokens=32, token_buckets=[16, 32])
    kinds = ["json", "regex"]
    want = _texts(llm, kinds, temperature=0.0, n=4)
    # tables compiled first, so the 8 requests below arrive together and run out of the 10
    # blocks; otherwise they trickle in as compiles end, at a pace the process's timing sets
    _texts(small, kinds, temperature=0.0, n=1)
    warm = small.engine.scheduler.num_preemptions
    got = _texts(small, kinds, temperature=0.0, n=4)
    assert small.engine.scheduler.num_preemptions > warm
    assert got == want
    before = small.engine.scheduler.num_preemptions
    for (text, reason, _), kind in zip(_texts(small, kinds, n=4), kinds * 4):
        assert reason == "stop"
        _check(kind, text)
    assert small.engine.scheduler.num_preemptions > before


def test_no_recompiles_and_the_pool_is_released(llm):
    """After warm-up nothing compiles (the step, the upload and slot programs), and
    finished requests give their pool space back."""
    warm = llm.num_compiles
    fns = (device_pool._write_states, device_pool._write_exceptions,
           device_pool._write_vocab, device_pool._set_slot)
    sizes = [f._cache_size() for f in fns]
    _texts(llm, ["json", "choice", "regex"], n=2)
    llm.generate(["x", "y"], [SP(max_tokens=3, structured_outputs=SO(regex="[a-c]+x")),
                              SP(max_tokens=4, structured_outputs=SO(regex=r"\d{2,3}"))],
                 use_tqdm=False)          # the second has byte-walk exceptions
    assert llm.num_compiles == warm
    assert [f._cache_size() for f in fns] == sizes
    automata = llm.engine.runner.automata
    llm.engine.step()        # the last finishes reach the runner with the next step
    assert not automata._req_key
    assert all(e.refs == 0 for e in automata._entries.values())


def test_a_single_choice_is_forced_even_greedy(llm):
    out = llm.generate(["x"], SP(max_tokens=8, temperature=0,
                                 structured_outputs=SO(choice=["forty-two"])), use_tqdm=False)
    assert out[0].outputs[0].text == "forty-two"
    assert out[0].outputs[0].finish_reason == "stop"


def test_host_and_device_paths_in_one_batch(llm):
    """json_object is not regular: it takes the host path (a grammar matcher on the
    host) in the same steps as device-constrained rows; both outputs are valid."""
    outs = llm.generate(["a", "b", "c"], [
        SP(max_tokens=60, temperature=1.0, seed=1, structured_outputs=SO(json_object=True)),
        _params("regex", 2), _params("choice", 3)], use_tqdm=False)
    assert "not regular" in (llm.engine.device_structured.last_fallback or "")
    assert outs[0].outputs[0].finish_reason in ("stop", "length")
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[0].outputs[0].text), dict)
    _check("regex", outs[1].outputs[0].text)
    _check("choice", outs[2].outputs[0].text)
