"""A constraint that starts after the reasoning (StructuredOutputsParams.reasoning_end),
end to end through jaxserve.LLM, on both structured paths: a regex runs as the device
automaton (asynchronous scheduling, multi-step decode), the same pattern as a Lark
grammar takes the host path (a matcher, masks filled by the scheduler).

A tiny random model over the embedded model's real tokenizer (llguidance needs a real
one). The oracle is the model itself: its unconstrained greedy output u. An end
sequence taken from u (its first occurrence ends at index k) must leave u[:k] exactly
as it was (free tokens, not digits), and the answer after it must match the pattern;
an end sequence the model never writes leaves the whole output unconstrained; an
unconstrained request in the same batch gets its tokens as if alone."""
from __future__ import annotations

import re

import numpy as np
import pytest

from engine_utils import tiny_config, tiny_weights
from jaxserve import SamplingParams as SP
from jaxserve.frontend.llm import LLM
from jaxserve.model.loader.default_model import default_gguf_path
from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
from jaxserve.sampling.params import RequestOutputKind
from jaxserve.sampling.params import StructuredOutputsParams as SO
from jaxserve.structured import device_pool

# these tests count compiles after warm-up: their engines warm up at start
pytestmark = pytest.mark.warmup

PATTERN = "[0-9]{3}"
CONSTRAINTS = {"device": dict(regex=PATTERN), "host": dict(grammar=f"start: /{PATTERN}/")}
PROMPT, OTHER = "Think, then answer with three digits:", "hello there"
N = 12
FINAL = RequestOutputKind.FINAL_ONLY        # multi-step decode runs for such requests


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def llm(tok):
    cfg = tiny_config(vocab_size=49152, eos_token_ids=(tok.eos_token_id,))
    m = LLM.from_weights(cfg, tiny_weights(cfg), tok, max_model_len=128, max_num_seqs=8,
                         max_num_batched_tokens=64, token_buckets=[8, 64], decode_steps=4)
    m.engine.device_structured.wait_s = 120.0       # a loaded machine compiles slowly
    m.engine.device_structured.queued_grace_s = 120.0
    return m


def _greedy(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _ends(u: list[int]) -> tuple[list[int], list[int], list[int]]:
    """From u: a one-token end (first occurrence at index >= 2), a two-token end, and a
    token u never contains."""
    k = next(i for i in range(2, len(u) - 1) if u[i] not in u[:i])
    j = next(i for i in range(1, len(u) - 2)
             if all(u[a:a + 2] != u[i:i + 2] for a in range(i)) and u[i + 1] != u[i])
    never = next(t for t in range(1000, 2000) if t not in u)
    return [u[k]], u[j:j + 2], [never]


@pytest.mark.parametrize("path", ["device", "host"])
def test_constraint_waits_for_the_reasoning_end(llm, tok, path):
    plain = SP(max_tokens=N, temperature=0, ignore_eos=True, output_kind=FINAL)
    u = _greedy(llm, [PROMPT], [plain])[0].token_ids
    alone = _greedy(llm, [OTHER], [plain])[0].token_ids
    assert tok.eos_token_id not in u
    ends = _ends(u)
    params = [SP(max_tokens=N, temperature=0, output_kind=FINAL,
                 structured_outputs=SO(**CONSTRAINTS[path], reasoning_end=e)) for e in ends]
    kinds: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def spy(*a, **kw):
        out = schedule(*a, **kw)
        kinds.append(out.num_steps)
        return out
    compiles = llm.num_compiles
    set_slot_programs = device_pool._set_slot._cache_size()
    llm.engine.device_structured.last_fallback = None
    llm.engine.scheduler.schedule = spy
    try:
        got = _greedy(llm, [PROMPT] * 3 + [OTHER], params + [plain])
    finally:
        del llm.engine.scheduler.schedule
    fallback = llm.engine.device_structured.last_fallback
    assert (fallback is None) if path == "device" else ("not regular" in fallback)
    for end, out in zip(ends[:2], got[:2]):
        k = next(i + len(end) for i in range(len(u)) if u[i:i + len(end)] == end)
        assert out.token_ids[:k] == u[:k], (end, out.token_ids, u)      # free until the end
        assert re.search("[^0-9]", tok.decode(u[:k]))      # which the pattern forbids
        answer = [t for t in out.token_ids[k:] if t != tok.eos_token_id]
        assert re.fullmatch(PATTERN, tok.decode(answer)), tok.decode(answer)
        assert out.finish_reason == "stop"
    assert got[2].token_ids == u and got[2].finish_reason == "length"     # never ended
    assert got[3].token_ids == alone                  # the batch's free row: unchanged
    assert llm.num_compiles == compiles and \
        device_pool._set_slot._cache_size() == set_slot_programs
    if path == "device":
        assert max(kinds) > 1, "multi-step decode was meant to run"


def test_slot_restart_replays_the_reasoning(tok):
    """After a preemption the slot restarts from the kept outputs: still reasoning
    (waiting, its last tokens remembered so a split end sequence still ends it), or
    answering from the state the tokens after the end lead to."""
    from jaxserve.structured.device_automaton import compile_tables
    from jaxserve.structured.device_vocab import TokenVocabulary
    V = 49152
    vocab = TokenVocabulary.from_tokenizer(tok, (tok.eos_token_id,), V)
    tables = compile_tables(PATTERN, vocab)
    digit = int(tok.encode("7", add_special_tokens=False)[0])
    auto = device_pool.DeviceAutomata(4, V, max_states=tables.num_states + 1)
    pool = auto.warmup(auto.init_pool(), 3)
    end = (500, 501)
    assert auto.attach("a", "re", tables, end) and auto.attach("b", "re", tables, end)
    pool = auto.start_slot(pool, 0, "a", [9, 500])            # half the end: waiting
    pool = auto.start_slot(pool, 1, "b", [9, 500, 501, digit])  # one answer digit kept
    wait, state = np.asarray(pool.slot_wait), np.asarray(pool.slot_state)
    assert wait[:2].tolist() == [1, 0]
    base = auto._entries["re"].base
    assert state[0] == base and state[1] == base + tables.walk([digit])
    pool = device_pool.advance(pool, np.array([0, 1]), np.array([501, digit]),
                               np.array([True, True]))
    assert np.asarray(pool.slot_wait)[0] == 0 and np.asarray(pool.slot_state)[0] == base
    assert np.asarray(pool.slot_state)[1] == base + tables.walk([digit, digit])
