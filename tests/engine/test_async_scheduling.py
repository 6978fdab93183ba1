"""Asynchronous scheduling: step N+1 is scheduled and dispatched before step N's tokens
reach the host; a decode row reads its pending token on the device.

The truth is transformers (greedy), the same engine run strictly in turn (seeded
sampling, stop strings, n > 1), and a deterministic fake model for the scheduler alone.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import jax
import pytest

from engine_utils import (hf_greedy, hf_model_from_weights, random_prompts, tiny_config,
                          tiny_tokenizer, tiny_weights)
from test_scheduler import FakeRunner, make, reference_output, req
from jaxserve import SamplingParams as SP
from jaxserve.frontend.llm import LLM
from jaxserve.request import FinishReason, Request

SMALL = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
             token_buckets=[16, 64])
ORDERS = {"async": {}, "pipelined": dict(async_scheduling=False),
          "in turn": dict(pipeline_steps=False)}
MAX_NEW = 12


# ------------------------------------------------------------- scheduler alone
def _truncate(out: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(out):
        if t in eos:
            return out[:i + 1]
    return out


def test_scheduler_one_step_ahead_with_fake_model():
    """schedule(N+1) before update(N): every output equals the fake model's, with
    preemption (pending tokens dropped), EOS (extra token dropped) and max_tokens (never
    scheduled past the limit); the fake runner checks every KV slot it reads."""
    sched, runner = make(num_blocks=12, bs=4, budget=16, max_num_seqs=6)
    reqs = []
    for i in range(10):
        prompt, max_tokens = list(range(i * 5, i * 5 + 3 + i % 7)), 1 + (i * 3) % 11
        ref = reference_output(prompt, max_tokens)
        # every other request has an EOS id that its output reaches before max_tokens
        eos = (ref[max_tokens // 2],) if i % 2 and max_tokens > 2 else ()
        reqs.append(req(f"r{i}", prompt, max_tokens=max_tokens, eos=eos))
    for r in reqs:
        sched.add_request(r)
    victims_with_pending = []
    orig_preempt = sched._preempt

    def spy_preempt(request):
        victims_with_pending.append(sched._pending.get(request.request_id, 0))
        orig_preempt(request)
    sched._preempt = spy_preempt
    sampled_rows: Counter = Counter()
    prev = None
    for _ in range(2000):
        if not sched.has_unfinished_requests() and prev is None:
            break
        out = sched.schedule()
        sampled_rows.update(out.sampling_req_ids)
        cur = (out, runner.execute(out)) if not out.is_empty else None
        if prev is not None:
            sched.update_from_output(*prev)
        sched.kv.check()
        prev = cur
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert any(p > 0 for p in victims_with_pending), victims_with_pending
    stopped = 0
    for r in reqs:
        want = _truncate(reference_output(r.prompt_token_ids, r.sampling_params.max_tokens),
                         r.eos_token_ids)
        assert r.output_token_ids == want, r.request_id
        if r.finish_reason == FinishReason.LENGTH:
            assert r.metrics.num_preemptions or sampled_rows[r.request_id] == len(want)
        else:
            stopped += 1
    assert stopped > 0, "no request stopped on EOS"


# --------------------------------------------------------------- whole engine
@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_weights(cfg), tiny_tokenizer()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(24, 128, 3, 90, seed=3)


@pytest.fixture(scope="module")
def reference(model, prompts):
    cfg, w, _ = model
    hf = hf_model_from_weights(cfg, w)
    return [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _make(model, order: str, eos: tuple[int, ...] = (), **kw) -> LLM:
    cfg, w, tok = model
    if eos:      # the weights do not depend on the EOS id
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return LLM.from_weights(cfg, w, tok, **{**SMALL, **ORDERS[order], **kw})


@pytest.fixture(scope="module")
def async_engine(model):
    """The async engine of the default settings, built once for the tests that run it
    as it is (each starts from an empty prefix cache; engine_pool.release checks the
    last one left nothing behind)."""
    from engine_pool import release
    llm = _make(model, "async")

    def get() -> LLM:
        release(llm)
        return llm
    return get


class _Spy:
    """Counts, per engine: rows fed on the device, sampling rows per request,
    preemptions of a request with a token still in flight."""

    def __init__(self, llm: LLM) -> None:
        self.fed = 0
        self.sampled: Counter = Counter()
        self.pending_victims = 0
        core = llm.engine
        sched, runner = core.scheduler, core.runner
        dispatch, schedule, preempt = runner.dispatch, sched.schedule, sched._preempt

        def spy_dispatch(so: Any) -> Any:
            step = dispatch(so)
            self.fed += int((step.batch.feed >= 0).sum())
            return step

        def spy_schedule() -> Any:
            so = schedule()
            self.sampled.update(so.sampling_req_ids)
            return so

        def spy_preempt(request: Request) -> None:
            self.pending_victims += sched._pending.get(request.request_id, 0) > 0
            preempt(request)
        runner.dispatch, sched.schedule, sched._preempt = spy_dispatch, spy_schedule, spy_preempt


def _run(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.slow
def test_greedy_eos_and_max_tokens_equal_transformers_in_every_order(model, prompts,
                                                                     reference):
    """Half the requests stop on EOS (mid-batch), all have different max_tokens; the
    async engine feeds decode tokens on the device and never samples past max_tokens."""
    params = [SP(max_tokens=1 + i % MAX_NEW, temperature=0, ignore_eos=i % 2 == 0)
              for i in range(len(prompts))]
    # EOS: the token the reference outputs produce most often before their limit
    eos = Counter(t for i, ref in enumerate(reference) if i % 2
                  for t in ref[1:params[i].max_tokens - 1]).most_common(1)[0][0]
    want = []
    for i, ref in enumerate(reference):
        out = ref[:params[i].max_tokens]
        want.append(out if params[i].ignore_eos else _truncate(out, (eos,)))
    assert sum(eos in w and not p.ignore_eos for w, p in zip(want, params)) >= 2, eos
    results = {}
    for order in ORDERS:
        llm = _make(model, order, eos=(eos,))
        spy = _Spy(llm)
        got = _run(llm, prompts, params)
        assert [g[0][0] for g in got] == want, order
        results[order] = got
        for i, g in enumerate(got):          # request i's only child: id "{i}-0"
            extra = 1 if g[0][2] == "stop" else 0
            assert spy.sampled[f"{i}-0"] <= len(want[i]) + extra, (order, i)
        assert (spy.fed > 0) == (order == "async"), (order, spy.fed)
    assert results["async"] == results["pipelined"] == results["in turn"]


@pytest.mark.slow
def test_seeded_sampling_stop_strings_and_n_unchanged(model, prompts, async_engine):
    params = [SP(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=7 + i, n=1 + i % 3,
                 stop=["w7", "w11 w"], logprobs=1 if i % 4 == 0 else None,
                 presence_penalty=0.3 if i % 5 == 0 else 0.0, min_tokens=i % 4)
              for i in range(12)]
    results = {order: _run(async_engine() if order == "async" else _make(model, order),
                           prompts[:12], params) for order in ORDERS}
    assert results["async"] == results["in turn"] == results["pipelined"]
    reasons = [c[2] for r in results["async"] for c in r]
    assert "stop" in reasons and "length" in reasons


def test_chunked_prefill_and_preemption_with_tokens_in_flight(model, prompts, reference):
    # 24-token steps split every longer prompt; 20 blocks of 16 tokens cannot hold 16
    # running sequences, so the scheduler preempts, often a request whose token is on
    # its way to the host (dropped, recomputed after resuming).
    llm = _make(model, "async", max_num_batched_tokens=24, token_buckets=[8, 24],
                num_kv_blocks=20)
    spy = _Spy(llm)
    got = _run(llm, prompts, SP(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [g[0][0] for g in got] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert spy.pending_victims > 0, "no request was preempted with a token in flight"
    assert spy.fed > 0


def test_aborts_while_steps_are_in_flight(async_engine, prompts, reference):
    """Abort some requests after a few steps (their state leaves the runner while a
    step that computes them is still running): the others are unaffected and every
    block comes back."""
    llm = async_engine()
    core = llm.engine
    reqs = [Request(f"q{i}", p, SP(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts[:10])]
    for r in reqs:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    reasons: dict[str, Any] = {}
    aborted = {"q1", "q4", "q7"}
    for step in range(200):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            tokens[o.req_id] += o.new_token_ids
            if o.finish_reason is not None:
                reasons[o.req_id] = o.finish_reason
        if step == 4:
            core.abort_requests(aborted)
    for i, r in enumerate(reqs):
        if r.request_id in aborted:
            assert r.finish_reason == FinishReason.ABORT
            assert tokens[r.request_id] == reference[i][:len(tokens[r.request_id])]
            assert len(tokens[r.request_id]) < MAX_NEW
        else:
            assert tokens[r.request_id] == reference[i]
            assert reasons[r.request_id] == FinishReason.LENGTH
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
    assert core.step() == []        # the last finishes reach the runner with the next step
    assert not core.runner.states, "runner kept state of finished requests"


@pytest.mark.warmup
@pytest.mark.parametrize("step_mode", ["layerwise", "fused", "hybrid"])
def test_no_recompiles_after_warmup(model, step_mode):
    llm = _make(model, "async", step_mode=step_mode)
    warm = llm.num_compiles
    for n, (lo, hi), sp in [(1, (3, 10), SP(max_tokens=5, temperature=0)),
                            (5, (50, 110), SP(max_tokens=3, temperature=0.7, seed=3, top_k=5)),
                            (16, (3, 60), SP(max_tokens=9, temperature=1.0, logprobs=2,
                                             frequency_penalty=0.5, n=2))]:
        _run(llm, random_prompts(n, 128, lo, hi, seed=n), sp)
    assert llm.num_compiles == warm


@pytest.mark.parametrize("step_mode,above", [("hybrid", 8), ("layerwise", 0), ("fused", None)])
def test_cpu_layerwise_steps_run_in_turn(model, prompts, step_mode, above):
    """On XLA:CPU a step run by the layerwise program (more tokens than the fused buckets
    take) is waited for inside dispatch(), pipelined engine or not: its outputs are ready
    when dispatch returns. Fused steps are left in flight (not waited for)."""
    llm = _make(model, "async", step_mode=step_mode, token_buckets=[4, 16, 64])
    runner = llm.engine.runner
    assert runner.in_turn_above == above
    seen: list[tuple[int, bool]] = []
    dispatch = runner.dispatch

    def spy(so: Any) -> Any:
        step = dispatch(so)
        ready = all(a.is_ready() for a in jax.tree_util.tree_leaves(step.out))
        seen.append((int(step.batch.tokens.shape[0]), ready))
        return step
    runner.dispatch = spy
    _run(llm, prompts[:6], SP(max_tokens=4, temperature=0))
    assert seen and any(above is not None and t > above for t, _ in seen) == (above is not None)
    for tokens, ready in seen:
        if above is not None and tokens > above:
            assert ready, f"a {tokens}-token step was left in flight"
