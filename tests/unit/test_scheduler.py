"""Scheduler driven by a fake runner + deterministic fake model.

The fake runner consumes SchedulerOutput diffs exactly as the real one must (state per
request, new block ids appended, states dropped on finish/preempt) and simulates the
KV cache: each computed token writes a fingerprint of its prefix into its slot, and
each row checks that every context slot it attends to holds the right fingerprint.
So stale blocks, wrong prefix hits and wrong diffs all fail loudly.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.request import FinishReason, Request, RequestStatus
from jaxserve.sampling.params import SamplingParams
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.core.sched.scheduler import Scheduler

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    return (sum(tokens) * 7 + len(tokens)) % VOCAB + 3     # never 0..2 (specials)


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


@dataclass(slots=True)
class _RowState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int


class FakeRunner:
    def __init__(self, sched: Scheduler, model: Callable[[list[int]], int] = next_token):
        self.sched, self.model, self.bs = sched, model, sched.block_size
        self.rows: dict[str, _RowState] = {}
        self.kv: dict[int, int] = {}                       # slot -> prefix fingerprint

    def _slot(self, row: _RowState, pos: int) -> int:
        return row.block_ids[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows
            self.rows[new.req_id] = _RowState(list(new.token_ids), list(new.block_ids),
                                              new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            row = self.rows[cached.req_id]
            assert row.num_computed == cached.num_computed_tokens
            row.block_ids += cached.new_block_ids
        sampled: dict[str, list[int]] = {}
        k = out.num_steps       # multi-step decode: k decode steps, row r in its first n
        for i in range(k):
            batch = {rid: n if k == 1 else 1 for rid, n in out.num_scheduled_tokens.items()
                     if k == 1 or i < n}
            for rid, n in batch.items():                      # write all K/V first
                row = self.rows[rid]
                assert row.block_ids == self.sched.kv.get_block_ids(rid), "diff lost blocks"
                for pos in range(row.num_computed, row.num_computed + n):
                    self.kv[self._slot(row, pos)] = hash(tuple(row.token_ids[:pos + 1]))
            for rid, n in batch.items():                      # then attend + sample
                row = self.rows[rid]
                row.num_computed += n
                for pos in range(row.num_computed):
                    assert self.kv[self._slot(row, pos)] == hash(tuple(row.token_ids[:pos + 1])), \
                        f"{rid}: KV slot for position {pos} holds the wrong content"
                if row.num_computed == len(row.token_ids):
                    token = self.model(row.token_ids)
                    row.token_ids.append(token)
                    sampled.setdefault(rid, []).append(token)
        return sampled


def make(num_blocks=64, bs=4, max_num_seqs=8, budget=32, max_model_len=128, **kw):
    kv = KVCacheManager(num_blocks, bs, hash_seed=0,
                        enable_prefix_caching=kw.pop("caching", True))
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=max_model_len, block_size=bs, **kw)
    return sched, FakeRunner(sched)


def req(rid, prompt, max_tokens=4, eos=(), **sp) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sp),
                   eos_token_ids=tuple(eos))


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    assert len(out.num_scheduled_tokens) == (len(out.scheduled_new_reqs)
                                             + len(out.scheduled_cached_reqs))
    sched.update_from_output(out, runner.execute(out))
    sched.kv.check()
    return out


def run(sched, runner, max_steps=2000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched, runner))
        assert len(outs) < max_steps, "no progress"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return outs


# ------------------------------------------------------------------ token budget
def test_chunked_prefill_spreads_a_long_prompt():
    sched, runner = make(budget=8)
    r = req("a", range(20), max_tokens=3)
    sched.add_request(r)
    outs = run(sched, runner)
    assert [o.num_scheduled_tokens["a"] for o in outs] == [8, 8, 4, 1, 1]
    assert [o.scheduled_new_reqs != [] for o in outs] == [True] + [False] * 4
    assert r.output_token_ids == reference_output(list(range(20)), 3)
    assert r.finish_reason == FinishReason.LENGTH and r.is_finished


def test_decode_and_prefill_share_a_step():
    sched, runner = make(budget=10)
    sched.add_request(req("a", range(4), max_tokens=5))
    step(sched, runner)
    sched.add_request(req("b", range(30), max_tokens=2))
    out = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_long_prefill_threshold_caps_each_chunk():
    sched, runner = make(budget=32, long_prefill_token_threshold=5)
    for rid in "ab":
        sched.add_request(req(rid, range(12), max_tokens=2))
    out = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 5, "b": 5}
    run(sched, runner)


def test_without_chunked_prefill_whole_prompts_only():
    sched, runner = make(budget=16, max_model_len=16, enable_chunked_prefill=False)
    sched.add_request(req("a", range(10), max_tokens=2))
    sched.add_request(req("b", range(20, 30), max_tokens=2))
    out = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 10}
    out = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}
    with pytest.raises(ValueError, match="chunked prefill"):
        make(budget=8, max_model_len=16, enable_chunked_prefill=False)


def test_max_num_seqs_respected():
    sched, runner = make(max_num_seqs=2)
    reqs = [req(f"r{i}", range(i, i + 5), max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outs = run(sched, runner)
    assert max(len(o.num_scheduled_tokens) for o in outs) == 2
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 3)


# ------------------------------------------------------------------- preemption
def test_preemption_with_tiny_pool_and_resume():
    sched, runner = make(num_blocks=8, bs=4, budget=64)
    reqs = [req(f"r{i}", range(10 * i, 10 * i + 8), max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    outs = run(sched, runner)
    preempted = set().union(*(o.preempted_req_ids for o in outs))
    assert preempted and sched.num_preemptions >= len(preempted)
    assert "r0" not in preempted                     # the oldest is never the victim
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 12)
        assert (r.metrics.num_preemptions > 0) == (r.request_id in preempted)
    # A resumed request comes back as a new request carrying prompt + outputs so far.
    first = next(i for i, o in enumerate(outs) if o.preempted_req_ids)
    victim = next(iter(outs[first].preempted_req_ids))
    resumed = next(n for o in outs[first + 1:] for n in o.scheduled_new_reqs
                   if n.req_id == victim)
    assert len(resumed.token_ids) > resumed.num_prompt_tokens == 8
    assert sum(r.metrics.num_preemptions for r in reqs) == sched.num_preemptions


def test_preempted_request_goes_to_front_of_waiting():
    sched, runner = make(num_blocks=4, bs=4, budget=64, max_num_seqs=2)
    a, b, c = (req(x, range(i * 8, i * 8 + 7), max_tokens=5) for i, x in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    while not b.metrics.num_preemptions:
        step(sched, runner)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b, c]
    run(sched, runner)


# -------------------------------------------------------------------- admission
def test_admission_rejects_requests_that_can_never_fit():
    sched, runner = make(num_blocks=4, bs=4, max_model_len=32)
    ok = req("ok", range(5), max_tokens=3)
    sched.add_request(ok)
    with pytest.raises(ValueError, match=r"prompt of 30 tokens \+ max_tokens=5 = 35 "
                                         r"tokens exceeds max_model_len=32"):
        sched.add_request(req("long", range(30), max_tokens=5))
    with pytest.raises(ValueError, match="needs 6 KV blocks .* only 4"):
        sched.add_request(req("big", range(20), max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("empty", []))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(req("zero", [1], max_tokens=0))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(req("ok", [1]))
    assert sched.get_num_unfinished_requests() == 1
    run(sched, runner)
    assert ok.output_token_ids == reference_output(list(range(5)), 3)


# ------------------------------------------------------------------ diffs / ids
def test_finished_ids_and_block_diffs():
    sched, runner = make(bs=2)
    sched.add_request(req("a", range(3), max_tokens=1))
    sched.add_request(req("b", range(10, 13), max_tokens=4))
    out = step(sched, runner)
    assert {n.req_id: n.block_ids for n in out.scheduled_new_reqs} == {"a": [0, 1],
                                                                        "b": [2, 3]}
    assert sched.get_request("a") is None            # finished after one token
    out = step(sched, runner)                        # b: 4 tokens fit in 2 blocks
    assert out.finished_req_ids == {"a"}
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens)
            for c in out.scheduled_cached_reqs] == [("b", [], 3)]
    out = step(sched, runner)                        # b's 5th token needs a block
    assert out.finished_req_ids == set()
    # a's partial block 1 (no hash) is reused first; its cached block 0 survives
    assert [c.new_block_ids for c in out.scheduled_cached_reqs] == [[1]]
    run(sched, runner)


def test_abort_waiting_and_running():
    sched, runner = make(max_num_seqs=1)
    a, b = req("a", range(6), max_tokens=50), req("b", range(6), max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    sched.finish_requests(["a", "b", "unknown"], FinishReason.ABORT)
    assert a.finish_reason == b.finish_reason == FinishReason.ABORT
    assert a.is_finished and b.is_finished and a.metrics.finished_time is not None
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty


def test_prefix_hit_reported_to_runner_and_metrics():
    sched, runner = make(bs=4)
    sched.add_request(req("a", range(10), max_tokens=2))
    run(sched, runner)
    b = req("b", list(range(9)) + [77], max_tokens=2)
    sched.add_request(b)
    out = step(sched, runner)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 2}
    assert b.metrics.num_cached_tokens == 8
    run(sched, runner)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)


def test_new_request_data_carries_eos_ids():
    sched, _ = make()
    sched.add_request(req("a", range(3), eos=(2, 9)))
    assert sched.schedule().scheduled_new_reqs[0].eos_token_ids == (2, 9)


def test_partial_prefill_rows_ignore_sampled_tokens():
    sched, _ = make(budget=4)
    r = req("a", range(10))
    sched.add_request(r)
    out = sched.schedule()
    assert sched.update_from_output(out, {"a": [5]}) == []
    assert r.output_token_ids == [] and r.num_computed_tokens == 4
    assert r.metrics.first_token_time is None


# --------------------------------------------------------------- stop conditions
def _finish_with(script: list[int], max_model_len=64, **kw) -> Request:
    sched, _ = make(max_model_len=max_model_len)
    r = req("a", [1, 2, 3], **kw)
    sched.add_request(r)
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, {"a": [script[len(r.output_token_ids)]]})
    assert r.is_finished and sched.kv.num_free_blocks == sched.kv.num_blocks
    assert r.metrics.first_token_time <= r.metrics.finished_time
    return r


def test_stop_on_eos():
    r = _finish_with([5, 9, 2, 5, 5], max_tokens=10, eos=(2,))
    assert r.output_token_ids == [5, 9, 2]
    assert (r.finish_reason, r.stop_reason) == (FinishReason.STOP, None)


def test_ignore_eos_runs_to_max_tokens():
    r = _finish_with([2, 2, 2, 2], max_tokens=4, eos=(2,), ignore_eos=True)
    assert r.output_token_ids == [2, 2, 2, 2] and r.finish_reason == FinishReason.LENGTH


def test_min_tokens_suppresses_eos_and_stop_ids():
    r = _finish_with([2, 7, 2, 5], max_tokens=10, eos=(2,), min_tokens=3,
                     stop_token_ids=[7])
    assert r.output_token_ids == [2, 7, 2]
    assert r.finish_reason == FinishReason.STOP


def test_stop_token_ids_set_stop_reason():
    r = _finish_with([5, 8, 7, 5], max_tokens=10, stop_token_ids=[7, 11])
    assert r.output_token_ids == [5, 8, 7]
    assert (r.finish_reason, r.stop_reason) == (FinishReason.STOP, 7)


def test_eos_on_last_allowed_token_is_stop():
    r = _finish_with([5, 2], max_tokens=2, eos=(2,))
    assert r.finish_reason == FinishReason.STOP


def test_max_model_len_when_max_tokens_is_none():
    r = _finish_with([5] * 20, max_model_len=9, max_tokens=None)
    assert len(r.output_token_ids) == 6 and r.num_tokens == 9
    assert r.finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------ random workloads
_workload = st.fixed_dictionaries({
    "prompts": st.lists(st.tuples(st.integers(1, 24), st.integers(0, 3),
                                  st.integers(1, 10)), min_size=1, max_size=7),
    "num_blocks": st.integers(10, 24),
    "bs": st.sampled_from([2, 4]),
    "budget": st.integers(4, 40),
    "max_num_seqs": st.integers(1, 5),
    "threshold": st.sampled_from([0, 3]),
    "caching": st.booleans(),
    "abort_at": st.integers(0, 30),
})


@settings(max_examples=40, deadline=None)
@given(_workload)
def test_random_workloads_match_reference(w):
    """Any mix of prompts (sharing prefixes), pool size, budget and caps: every
    finished request's output equals the unbatched reference; nothing leaks."""
    sched, runner = make(num_blocks=w["num_blocks"], bs=w["bs"], budget=w["budget"],
                         max_num_seqs=w["max_num_seqs"], max_model_len=64,
                         long_prefill_token_threshold=w["threshold"], caching=w["caching"])
    reqs = []
    for i, (length, family, max_tokens) in enumerate(w["prompts"]):
        r = req(f"r{i}", [family] * 4 + [(family * 5 + j) % 7 for j in range(length)],
                max_tokens=max_tokens)
        try:
            sched.add_request(r)
            reqs.append(r)
        except ValueError as e:
            assert "KV blocks" in str(e)
    steps = 0
    while sched.has_unfinished_requests():
        if steps == w["abort_at"] and reqs:
            sched.finish_requests(reqs[-1].request_id, FinishReason.ABORT)
        step(sched, runner)
        steps += 1
        assert steps < 2000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    for r in reqs:
        if r.finish_reason != FinishReason.ABORT:
            assert r.output_token_ids == reference_output(r.prompt_token_ids,
                                                          r.sampling_params.max_tokens)
