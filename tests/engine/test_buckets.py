"""BucketSet: default token buckets, bucket picking and the padding-aware prefill chunk."""
from __future__ import annotations

import pytest

from jaxserve.worker.buckets import BucketSet, default_min_token_bucket, power_of_two_buckets


def build(**kw) -> BucketSet:
    base = dict(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048,
                block_size=16, single_table_width=True)
    return BucketSet.build(**{**base, **kw})


def test_cpu_default_starts_at_one_token():
    # A single decode must not be padded: the CPU default holds 1 and every power of two
    # from 4 (two decodes cost the same in the 4-token bucket: buckets.py)
    assert default_min_token_bucket("cpu") == 1
    assert build(min_token_bucket=None).token_buckets == (1, 4, 8, 16, 32, 64, 128, 256, 512)
    assert build(min_token_bucket=1, max_num_batched_tokens=2).token_buckets == (1, 2)
    assert build().pick(1, 3) == (1, 128)


def test_accelerator_default_starts_at_eight():
    assert default_min_token_bucket("gpu") == 8 and default_min_token_bucket("tpu") == 8
    assert build(min_token_bucket=8).token_buckets == (8, 16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize("smallest,budget,want", [
    (1, 1, [1]), (1, 6, [1, 2, 4, 6]), (16, 8, [8]), (3, 20, [3, 6, 12, 20])])
def test_power_of_two_buckets_end_at_budget(smallest, budget, want):
    assert power_of_two_buckets(smallest, budget) == want


def test_explicit_buckets_are_capped_and_end_at_budget():
    bs = build(token_buckets=[1000, 3, 3, 64], max_num_batched_tokens=256)
    assert bs.token_buckets == (3, 64, 256)


@pytest.mark.parametrize("n", range(1, 513))
def test_pick_is_smallest_bucket_that_fits(n):
    bs = build()
    t, _ = bs.pick(n, 0)
    assert t >= n and all(b < n for b in bs.token_buckets if b < t)


def test_rows_follow_tokens_up_to_max_num_seqs():
    bs = build()
    assert [bs.rows_for(t) for t in (1, 8, 64, 512)] == [1, 8, 64, 64]


@pytest.mark.parametrize("used,wanted,want", [
    (2, 128, 126),     # 130 tokens would pad to 256: end the step on 128 instead
    (0, 150, 128),     # 150 -> 256 pads 106 > 22 deferred
    (0, 200, 200),     # 200 -> 256 pads 56 < 72 deferred: keep
    (0, 128, 128),     # exactly a bucket
    (128, 20, 20),     # the lower bucket is already full: never an empty chunk
    (3, 2, 2),         # 5 -> 8 pads 3 > 1 deferred, but a cut to 4 saves too little
    (20, 14, 12),      # 34 -> 64 pads 30 > 2 deferred: end on 32
    (4, 1, 1),         # a single token on a full bucket stays
    (0, 512, 512),     # the budget
])
def test_fit_chunk(used, wanted, want):
    assert build().fit_chunk(used, wanted) == want


def test_fit_chunk_never_raises_padding():
    """Exhaustively: the cut step never pads more than the uncut one, and keeps >= 1 token."""
    bs = build()
    for used in range(0, 512):
        for wanted in range(1, 513 - used):
            n = bs.fit_chunk(used, wanted)
            assert 1 <= n <= wanted
            t_cut, _ = bs.pick(used + n, 0)
            t_full, _ = bs.pick(used + wanted, 0)
            assert t_cut - (used + n) <= t_full - (used + wanted)


@pytest.mark.warmup
@pytest.mark.slow   # compiles every default bucket: over a minute on 2 cores
def test_default_buckets_compile_once_and_run_every_batch_size():
    """The default (small) buckets: warm-up compiles them all, then batches of 1..16
    requests and chunked prompts run in their own small buckets without recompiling, and
    each request's tokens equal the same prompt run alone (an independent truth)."""
    from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights

    from jaxserve import SamplingParams
    from jaxserve.frontend.llm import LLM

    cfg = tiny_config()
    llm = LLM.from_weights(cfg, tiny_weights(cfg), tiny_tokenizer(), max_model_len=128,
                           max_num_seqs=16, max_num_batched_tokens=64)
    assert llm.engine.buckets.token_buckets == (1, 4, 8, 16, 32, 64)
    warm = llm.num_compiles
    assert warm >= len(llm.engine.buckets.all_shapes())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(16, 128, 2, 90, seed=7)
    alone = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
             .outputs[0].token_ids for p in prompts[:3]]
    for n in (1, 3, 5, 16):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], params,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:3]] == alone[:n]
    assert llm.num_compiles == warm


def test_scheduler_ends_a_step_on_a_bucket_and_outputs_are_unchanged():
    """Two decodes running, a 40-token prompt arrives: 42 tokens would pad to 64, so the
    scheduler takes 30 prompt tokens (step = 32) and the other 10 ride with the next
    step's decodes. Every request's tokens equal the reference (the unchanged model)."""
    from test_scheduler import make, reference_output, req, run, step

    bs = build(max_num_batched_tokens=64, token_buckets=[1, 2, 4, 8, 16, 32, 64])
    sched, runner = make(budget=64, fit_chunk=bs.fit_chunk)
    a, b = req("a", range(5), max_tokens=6), req("b", range(7, 12), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)                                    # both prompts: 10 tokens
    c = req("c", range(20, 60), max_tokens=3)
    sched.add_request(c)
    out = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 30}
    out = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 10}
    run(sched, runner)
    for r, p, n in ((a, range(5), 6), (b, range(7, 12), 6), (c, range(20, 60), 3)):
        assert r.output_token_ids == reference_output(list(p), n)


def test_scheduler_without_fit_chunk_fills_the_budget():
    from test_scheduler import make, req, step

    sched, runner = make(budget=64)
    sched.add_request(req("a", range(5), max_tokens=6))
    step(sched, runner)
    sched.add_request(req("c", range(20, 60), max_tokens=3))
    assert step(sched, runner).num_scheduled_tokens == {"a": 1, "c": 40}


def test_sampler_rows_exact_up_to_8_then_shared_buckets():
    b = BucketSet.build(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048,
                        block_size=16, min_token_bucket=1)
    got = {t: b.sampler_rows(b.rows_for(t)) for t in b.token_buckets}
    assert got == {1: 1, 4: 4, 8: 8, 16: 64, 32: 64, 64: 64, 128: 64, 256: 64, 512: 64}
    big = BucketSet.build(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=4096,
                          block_size=16, min_token_bucket=8)
    assert [big.sampler_rows(r) for r in (8, 9, 64, 65, 200, 256)] == [8, 64, 64, 256, 256, 256]


@pytest.mark.warmup
@pytest.mark.slow
def test_padded_sampler_rows_change_no_token_and_share_one_program():
    """Layerwise steps of 16 and 32 rows sample through the 64-row program (rows padded,
    invalid): the same greedy and seeded tokens as a run whose every bucket has its own
    rows, and one sampler compile for the three buckets."""
    from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
    from jaxserve import SamplingParams as SP
    from jaxserve.worker import buckets as buckets_mod
    from jaxserve.frontend.llm import LLM

    cfg = tiny_config()
    w, tok = tiny_weights(cfg), tiny_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in random_prompts(12, 128, 3, 30, seed=3)]
    params = [SP(max_tokens=5, temperature=0, ignore_eos=True),
              SP(max_tokens=5, temperature=0.9, top_p=0.8, seed=4, ignore_eos=True)] * 6
    kw = dict(max_model_len=128, max_num_seqs=64, max_num_batched_tokens=64,
              token_buckets=[16, 32, 64], step_mode="layerwise")

    def run():
        llm = LLM.from_weights(cfg, w, tok, **kw)
        sampler = llm.engine.runner._step._sampler
        outs = [o.outputs[0].token_ids
                for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, sampler._compiled
    padded, compiled = run()
    assert {key[0][0] for key in compiled} == {64}       # logits rows: one shared program
    original = buckets_mod.BucketSet.sampler_rows
    try:
        buckets_mod.BucketSet.sampler_rows = lambda self, rows: rows
        exact, compiled = run()
    finally:
        buckets_mod.BucketSet.sampler_rows = original
    assert {key[0][0] for key in compiled} == {16, 32, 64}
    assert padded == exact
