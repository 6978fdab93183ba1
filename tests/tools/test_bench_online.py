"""bench.latency.run_online: Poisson arrivals against the engine in-process."""
from __future__ import annotations

from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights

from jaxserve.bench.latency import poisson_arrivals, run_online
from jaxserve.frontend.llm import LLM


def test_poisson_arrivals_start_at_zero_and_have_the_rate():
    a = poisson_arrivals(4000, 5.0, seed=1)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert abs(len(a) / a[-1] - 5.0) < 0.3          # ~3.5 sigma for 4000 arrivals
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]


def test_run_online_times_every_token_of_every_request():
    cfg = tiny_config()
    llm = LLM.from_weights(cfg, tiny_weights(cfg), tiny_tokenizer(), max_model_len=128,
                           max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[8, 64])
    prompts = random_prompts(6, 128, 5, 40, seed=3)
    res = run_online(llm, prompts, 7, rate=40.0, seed=0)
    assert res["completed"] == 6 and res["num_prompts"] == 6
    assert res["num_itl"] == 6 * (7 - 1)            # one gap between each pair of tokens
    assert res["mean_ttft_ms"] > 0 and res["mean_itl_ms"] > 0
    assert res["p99_itl_ms"] >= res["median_itl_ms"]
    # the arrivals span ~5 / 40 s, so the run lasts at least that long
    assert res["duration_s"] >= poisson_arrivals(6, 40.0, seed=0)[-1]
    assert not llm.engine.has_unfinished_requests()
