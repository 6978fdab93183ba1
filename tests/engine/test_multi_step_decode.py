"""Multi-step decode: a step of only decode rows runs k decode steps in one device program
(scheduler: SchedulerOutput.num_steps; runner: the fused step's loop).

The truth is a deterministic fake model for the scheduler alone (every KV slot read is
checked), transformers for greedy tokens, and the same engine with multi-step decode off
for everything else (seeded sampling, logprobs, penalties, min_tokens, stop strings, n).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import jax
import numpy as np
import pytest

from engine_utils import (hf_greedy, hf_model_from_weights, random_prompts, tiny_config,
                          tiny_tokenizer, tiny_weights)
from test_scheduler import make, reference_output, req
from jaxserve import SamplingParams as SP
from jaxserve.frontend.llm import LLM
from jaxserve.request import FinishReason
from jaxserve.sampling.params import RequestOutputKind

FINAL = dict(output_kind=RequestOutputKind.FINAL_ONLY)
# token buckets of <= 8 run on the fused step (CPU hybrid), which runs multi-step decode
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
              token_buckets=[1, 2, 4, 8, 64])
MAX_NEW = 14


def _truncate(out: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(out):
        if t in eos:
            return out[:i + 1]
    return out


# ------------------------------------------------------------- scheduler alone
@pytest.mark.parametrize("num_blocks", [16, 64], ids=["preempting", "roomy"])
@pytest.mark.parametrize("one_ahead", [False, True], ids=["in turn", "one step ahead"])
def test_fake_model_outputs_with_multi_step(one_ahead, num_blocks):
    """Outputs equal the fake model's with multi-step steps (k capped by each row's
    length limit: a request that ends on its length never samples past it), EOS mid-way
    through a multi-step (later tokens dropped), preemptions in the ordinary steps
    between (16 blocks), and one step scheduled before the last one's tokens are
    appended."""
    sched, runner = make(num_blocks=num_blocks, bs=4, budget=32, max_num_seqs=10,
                         decode_steps=4)
    reqs = []
    for i in range(10):
        prompt, max_tokens = list(range(i * 7, i * 7 + 2 + i % 5)), 8 + (i * 5) % 13
        ref = reference_output(prompt, max_tokens)
        eos = (ref[max_tokens // 2],) if i % 3 == 1 else ()
        reqs.append(req(f"r{i}", prompt, max_tokens=max_tokens, eos=eos, **FINAL))
    for r in reqs:
        sched.add_request(r)
    sampled: Counter = Counter()
    steps: Counter = Counter()
    prev = None
    for _ in range(1000):
        if not sched.has_unfinished_requests() and prev is None:
            break
        out = sched.schedule()
        steps[out.num_steps] += 1
        if out.num_steps > 1:
            assert all(1 <= n <= out.num_steps for n in out.num_scheduled_tokens.values())
            assert len(out.sampling_req_ids) == len(out.num_scheduled_tokens)
        cur = None
        if not out.is_empty:
            got = runner.execute(out)
            sampled.update({rid: len(t) for rid, t in got.items()})
            cur = (out, got)
        if not one_ahead and cur is not None:
            sched.update_from_output(*cur)
            cur = None
        if prev is not None:
            sched.update_from_output(*prev)
        sched.kv.check()
        prev = cur
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "KV blocks leaked"
    assert sum(v for k, v in steps.items() if k > 1) >= 2, steps
    assert (sched.num_preemptions > 0) == (num_blocks == 16)
    for r in reqs:
        want = _truncate(reference_output(r.prompt_token_ids, r.sampling_params.max_tokens),
                         r.eos_token_ids)
        assert r.output_token_ids == want, r.request_id
        if r.finish_reason == FinishReason.LENGTH and not r.metrics.num_preemptions:
            assert sampled[r.request_id] == len(want), r.request_id


def _decoding(sched, runner, *reqs):
    """Add the requests and run one (ordinary) step."""
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_steps == 1
    sched.update_from_output(out, runner.execute(out))


def test_when_a_step_is_multi_step():
    # every running request decodes: k = decode_steps, each row k tokens, k pending
    sched, runner = make(decode_steps=4)
    _decoding(sched, runner, req("a", [1, 2, 3], max_tokens=20, **FINAL),
              req("b", [4, 5], max_tokens=20, **FINAL))
    out = sched.schedule()
    assert out.num_steps == 4 and out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert sched._pending == {"a": 4, "b": 4}
    sched.update_from_output(out, runner.execute(out))
    assert [len(sched.requests[r].output_token_ids) for r in "ab"] == [5, 5]

    # each row's k_r capped by its length limit (max_tokens 3: 1 out, 2 left)
    sched, runner = make(decode_steps=4)
    _decoding(sched, runner, req("a", [1, 2, 3], max_tokens=20, **FINAL),
              req("b", [4, 5], max_tokens=3, **FINAL))
    out = sched.schedule()
    assert out.num_steps == 4 and out.num_scheduled_tokens == {"a": 4, "b": 2}
    assert sched._pending == {"a": 4, "b": 2}
    sched.update_from_output(out, runner.execute(out))
    assert len(sched.requests["a"].output_token_ids) == 5 and "b" not in sched.requests
    # ...and when every row has at most one token left, an ordinary step
    sched, runner = make(decode_steps=4)
    _decoding(sched, runner, req("a", [1, 2, 3], max_tokens=2, **FINAL))
    assert sched.schedule().num_steps == 1

    # not while a request waits, streams, prefills, or past max rows
    sched, runner = make(decode_steps=4, max_num_seqs=8)
    _decoding(sched, runner, req("a", [1, 2, 3], max_tokens=20, **FINAL))
    sched.add_request(req("w", [9, 9, 9], max_tokens=5, **FINAL))
    assert sched.schedule().num_steps == 1
    for kind, streams, want in ((RequestOutputKind.DELTA, False, 1),
                                (RequestOutputKind.CUMULATIVE, False, 1),
                                (RequestOutputKind.DELTA, True, 4)):
        sched, runner = make(decode_steps=4, multi_step_streams=streams)
        _decoding(sched, runner, req("a", [1, 2, 3], max_tokens=20, output_kind=kind))
        assert sched.schedule().num_steps == want, (kind, streams)
    sched, runner = make(decode_steps=4, decode_steps_max_rows=1)
    _decoding(sched, runner, req("a", [1, 2], max_tokens=20, **FINAL),
              req("b", [3, 4], max_tokens=20, **FINAL))
    assert sched.schedule().num_steps == 1
    # a long prompt prefilled in chunks: no multi-step until it decodes
    sched, runner = make(decode_steps=4, budget=8, long_prefill_token_threshold=4)
    _decoding(sched, runner, req("a", list(range(10)), max_tokens=20, **FINAL))
    assert sched.schedule().num_steps == 1

    # the KV pool must hold every row's k tokens without a preemption: a prompt of 4
    # fills one block of 4, its 4 decode steps need one more (2 free)...
    sched, runner = make(num_blocks=3, bs=4, decode_steps=4)
    _decoding(sched, runner, req("a", [1, 2, 3, 4], max_tokens=8, **FINAL))
    out = sched.schedule()
    assert out.num_steps == 4
    # ...two prompts of 7 fill all 4 blocks; 4 decode steps would need one more each
    sched, runner = make(num_blocks=4, bs=4, decode_steps=4, caching=False)
    _decoding(sched, runner, req("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=8, **FINAL),
              req("b", [1, 2, 3, 4, 5, 6, 7], max_tokens=8, **FINAL))
    assert sched.kv.num_free_blocks == 0
    assert sched.schedule().num_steps == 1


def test_decode_steps_must_be_positive():
    with pytest.raises(ValueError, match="decode_steps"):
        make(decode_steps=0)


# --------------------------------------------------------------- whole engine
@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_weights(cfg), tiny_tokenizer()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, 128, 3, 40, seed=5)


@pytest.fixture(scope="module")
def hf_reference(model, prompts):
    """transformers' greedy tokens for the prompts, computed once for both orders."""
    cfg, w, _ = model
    hf = hf_model_from_weights(cfg, w)
    return [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _make(model, eos: tuple[int, ...] = (), **kw) -> LLM:
    cfg, w, tok = model
    if eos:
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return LLM.from_weights(cfg, w, tok, **{**ENGINE, **kw})


def _shared(tiny_llm, warmup: bool = True, **kw) -> LLM:
    """The session's engine on the `model` fixture's tiny model (engine_pool) with these
    arguments: the multi-step engine that the sampling, streaming and no-recompile tests
    all use is built, and warmed up, once."""
    return tiny_llm(**{**ENGINE, **kw}, warmup=warmup)


class _StepCounter:
    """Counts the runner's steps by num_steps."""

    def __init__(self, llm: LLM) -> None:
        self.steps: Counter = Counter()
        runner = llm.engine.runner
        dispatch = runner.dispatch

        def spy(so: Any) -> Any:
            self.steps[so.num_steps] += 1
            return dispatch(so)
        runner.dispatch = spy

    @property
    def multi(self) -> int:
        return sum(v for k, v in self.steps.items() if k > 1)


def _run(llm: LLM, prompts, params) -> list[list[tuple]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    return [[(c.token_ids, c.text, c.finish_reason,
              None if c.logprobs is None else [{t: round(lp.logprob, 4) for t, lp in e.items()}
                                               for e in c.logprobs])
             for c in o.outputs] for o in outs]


@pytest.mark.parametrize("order", ["async", "in turn"])
@pytest.mark.slow
def test_greedy_equals_transformers_with_eos_mid_step(model, prompts, hf_reference, order):
    """Greedy tokens equal transformers' with multi-step decode, in both engine orders;
    requests stop on EOS inside a multi-step (its later tokens dropped) and on their
    max_tokens (never passed)."""
    ref = hf_reference
    eos = Counter(t for r in ref for t in r[2:MAX_NEW - 2]).most_common(1)[0][0]
    params = [SP(max_tokens=3 + i % (MAX_NEW - 2), temperature=0, ignore_eos=i % 2 == 0)
              for i in range(len(prompts))]
    want = [r[:p.max_tokens] if p.ignore_eos else _truncate(r[:p.max_tokens], (eos,))
            for r, p in zip(ref, params)]
    order_kw = {} if order == "async" else dict(pipeline_steps=False)
    llm = _make(model, eos=(eos,), decode_steps=4, **order_kw)
    counter = _StepCounter(llm)
    got = _run(llm, prompts, params)
    assert [g[0][0] for g in got] == want
    assert counter.multi > 0, counter.steps
    assert max(counter.steps) <= 4


@pytest.mark.slow
def test_sampling_logprobs_penalties_and_stops_equal_single_steps(tiny_llm_factory, prompts):
    """Seeded and unseeded sampling, logprobs, penalties, min_tokens, stop strings and
    n > 1 give what the same engine gives one decode step at a time."""
    multi = _shared(tiny_llm_factory, decode_steps=4)
    single = _shared(tiny_llm_factory, decode_steps=1, warmup=False)
    # unseeded: the step counter advances by k, so each draw keeps its key. Unseeded
    # draws depend on the engine's seed and step count: both engines are put in the
    # state of fresh engines built with seed=3, whatever the shared engines ran before.
    unseeded = [SP(max_tokens=MAX_NEW, temperature=1.0, **FINAL)] * 3
    for runner in (multi.engine.runner, single.engine.runner):
        runner.base_key, runner.step_count = jax.random.PRNGKey(3), 0
    assert _run(multi, prompts[:3], unseeded) == _run(single, prompts[:3], unseeded)
    params = [SP(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=11 + i,
                 n=1 + i % 2, stop=["w7", "w11 w"], logprobs=2 if i % 3 == 0 else None,
                 presence_penalty=0.4 if i % 4 == 0 else 0.0,
                 repetition_penalty=1.3 if i % 4 == 1 else 1.0, min_tokens=i % 5)
              for i in range(len(prompts))]
    counter = _StepCounter(multi)
    got = _run(multi, prompts, params)
    assert counter.multi > 0, counter.steps
    assert got == _run(single, prompts, params)
    reasons = [c[2] for r in got for c in r]
    assert "stop" in reasons and "length" in reasons


@pytest.mark.slow
def test_streams_step_one_token_at_a_time_unless_asked(model, prompts, tiny_llm_factory):
    """A streaming request (output_kind DELTA) gets every token when it is sampled; with
    multi_step_streams its deltas come k tokens at a time, the same tokens."""
    def stream(llm: LLM) -> tuple[list[list[int]], Counter]:
        counter = _StepCounter(llm)
        params = SP(max_tokens=MAX_NEW, temperature=0, ignore_eos=True,
                    output_kind=RequestOutputKind.DELTA)
        llm.add_request({"prompt_token_ids": prompts[0]}, params)
        deltas = []
        for _ in range(200):
            if not llm.engine.has_unfinished_requests():
                break
            outputs, stopped = llm.processor.process(llm.engine.step())
            assert not stopped
            deltas += [o.outputs[0].token_ids for o in outputs if o.outputs[0].token_ids]
        return deltas, counter.steps
    one, steps = stream(_shared(tiny_llm_factory, decode_steps=4))
    assert set(steps) == {1} and all(len(d) == 1 for d in one)
    many, steps = stream(_make(model, decode_steps=4, multi_step_streams=True))
    assert max(steps) == 4 and max(len(d) for d in many) == 4
    assert sum(many, []) == sum(one, [])


@pytest.mark.warmup
def test_no_compiles_after_warmup_with_multi_step(tiny_llm_factory, prompts):
    """Every step, multi-step or not, runs a program compiled at warm-up (the number of
    steps is an input, not a shape)."""
    llm = _shared(tiny_llm_factory, decode_steps=4)
    before = llm.engine.num_compiles
    counter = _StepCounter(llm)
    _run(llm, prompts, [SP(max_tokens=3 + i, temperature=0, ignore_eos=True)
                        for i in range(len(prompts))])
    assert counter.multi > 0, counter.steps
    assert llm.engine.num_compiles == before


@pytest.mark.slow
def test_device_automaton_rows_in_multi_step():
    """A constraint run on the device (structured/device_pool.py) advances its automaton
    in every decode step of the loop: outputs match the regex and equal single steps'."""
    import re
    from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
    from jaxserve.model.loader.default_model import default_gguf_path
    from jaxserve.sampling.params import StructuredOutputsParams as SO
    tok = load_gguf_tokenizer(default_gguf_path())
    cfg = tiny_config(vocab_size=49152, eos_token_ids=(tok.eos_token_id,))
    w = tiny_weights(cfg)
    ip = r"[0-9]{1,3}(\.[0-9]{1,3}){3}"
    params = [SP(max_tokens=24, temperature=1.0, seed=i, structured_outputs=SO(regex=ip))
              for i in range(3)]

    def run(k: int) -> tuple[list[str], Counter]:
        llm = LLM.from_weights(cfg, w, tok, **{**ENGINE, "max_model_len": 256},
                               decode_steps=k)
        llm.engine.device_structured.wait_s = 120.0
        llm.engine.device_structured.queued_grace_s = 120.0
        counter = _StepCounter(llm)
        outs = llm.generate(["an address:", "ip?", "hello"], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs], counter.steps
    multi, steps = run(4)
    assert max(steps) > 1, steps
    assert all(re.fullmatch(ip, t) for t in multi), multi
    assert multi == run(1)[0]


def test_advance_decode_moves_positions_slots_and_lengths():
    """The metadata of decode step i: positions + i, the KV slot of that position from
    the row's block table, lengths + i; padding tokens and rows unchanged."""
    import jax.numpy as jnp
    from jaxserve.attention.metadata import AttentionMetadata
    from jaxserve.worker.step_programs import advance_decode
    bs, pad = 4, 10 * 4
    md = AttentionMetadata(
        positions=jnp.array([5, 2, 0, 0]), slot_mapping=jnp.array([3 * 4 + 1, 7 * 4 + 2, pad, pad]),
        token_rows=jnp.array([0, 1, 4, 4]), context_lens=jnp.array([5, 2, 0, 0]),
        seq_lens=jnp.array([6, 3, 0, 0]), query_start_loc=jnp.array([0, 1, 2, 2, 2]),
        block_tables=jnp.array([[6, 3, 9], [7, 8, 0], [0, 0, 0], [0, 0, 0]]),
        logits_indices=jnp.array([0, 1, 0, 0]))
    same = advance_decode(md, 0, bs)
    for a, b in zip(dataclasses.astuple(same), dataclasses.astuple(md)):
        assert a is None or np.array_equal(a, b)
    m3 = advance_decode(md, 3, bs)
    assert m3.positions.tolist() == [8, 5, 0, 0]
    assert m3.slot_mapping.tolist() == [9 * 4 + 0, 8 * 4 + 1, pad, pad]
    assert m3.seq_lens.tolist() == [9, 6, 0, 0] and m3.context_lens.tolist() == [8, 5, 0, 0]
