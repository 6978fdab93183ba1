"""Prometheus metrics under vLLM's names (--metrics-compat vllm) over real HTTP, parsed
with prometheus_client's own text parser: every name vLLM's ecosystem reads exists with
vLLM's type, labels and buckets, and the values move with requests. The same
measurements under jaxserve's names (the default) are checked on ServerMetrics directly."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import MODEL_NAME, ServerThread, tiny_args, tiny_parts
from jaxserve.server.metrics import ServerMetrics

# name -> type, as vLLM exports them (vllm/v1/metrics/loggers.py).
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}
# vLLM's bucket upper bounds, written out here as the independent reference.
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                         0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                                         40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                                         80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                         20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                                         960.0, 1920.0, 7680.0],
    # max_model_len is 128 in the test server
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100],
    "vllm:request_max_num_generation_tokens": [1, 2, 5, 10, 20, 50, 100],
    "vllm:request_params_max_tokens": [1, 2, 5, 10, 20, 50, 100],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                    16384],
}
VLLM_BUCKETS["vllm:time_per_output_token_seconds"] = VLLM_BUCKETS[
    "vllm:inter_token_latency_seconds"]
for _n in ("queue_time", "prefill_time", "decode_time"):
    VLLM_BUCKETS[f"vllm:request_{_n}_seconds"] = VLLM_BUCKETS["vllm:e2e_request_latency_seconds"]


@pytest.fixture(scope="module")
def server():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args(metrics_compat="vllm")
    engine = build_engine(args, cfg, weights, tok, warmup=True)
    srv = ServerThread(engine, tok, args)
    yield srv
    srv.stop()


def scrape(url: str) -> dict[str, tuple[str, list]]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, suffix: str = "", **labels: str) -> float:
    """The one sample `name + suffix` whose labels include `labels`."""
    _, samples = fams[name]
    hits = [s.value for s in samples if s.name == name + suffix
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, suffix, labels, samples)
    return hits[0]


def test_every_vllm_name_with_its_type_labels_and_buckets(server):
    fams = scrape(server.url)
    for name, kind in VLLM_TYPES.items():
        assert name in fams, name
        assert fams[name][0] == kind, (name, fams[name][0])
        for s in fams[name][1]:
            assert s.labels["model_name"] == MODEL_NAME and s.labels["engine"] == "0", s
    for name, bounds in VLLM_BUCKETS.items():
        les = [float(s.labels["le"]) for s in fams[name][1] if s.name == name + "_bucket"]
        assert les == bounds + [float("inf")], name
    # Every finish reason's series exists before any request finished with it.
    for reason in ("stop", "length", "abort"):
        value(fams, "vllm:request_success", "_total", finished_reason=reason)


def test_values_move_with_requests(server):
    before = scrape(server.url)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    prompts = ["w5 w6 w7", "w8 w9", "w10 w11 w12 w13"]
    for p in prompts:
        r = client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
    after = scrape(server.url)

    def delta(name: str, suffix: str = "", **labels: str) -> float:
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    n_prompt = sum(len(p.split()) for p in prompts)
    assert delta("vllm:request_success", "_total", finished_reason="length") == 3
    assert delta("vllm:prompt_tokens", "_total") == n_prompt
    assert delta("vllm:generation_tokens", "_total") == 3 * 8
    assert delta("vllm:request_prompt_tokens", "_sum") == n_prompt
    assert delta("vllm:request_generation_tokens", "_sum") == 3 * 8
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        assert delta(name, "_count") == 3, name
    # 8 tokens, one per step: up to 7 gaps per request (fewer if outputs coalesce).
    gaps = delta("vllm:inter_token_latency_seconds", "_count")
    assert 3 <= gaps <= 21
    assert delta("vllm:time_per_output_token_seconds", "_count") == gaps
    # decode time = the sum of the gaps; each phase is within the request's e2e time.
    assert delta("vllm:request_decode_time_seconds", "_sum") == pytest.approx(
        delta("vllm:inter_token_latency_seconds", "_sum"))
    e2e = delta("vllm:e2e_request_latency_seconds", "_sum")
    assert 0 < delta("vllm:time_to_first_token_seconds", "_sum") <= e2e
    assert delta("vllm:request_queue_time_seconds", "_sum") <= \
        delta("vllm:time_to_first_token_seconds", "_sum")
    assert delta("vllm:prefix_cache_queries", "_total") >= n_prompt - 3
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting") == 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    # jaxserve's own extras stay under its prefix
    assert value(after, "jaxserve:engine_steps", "_total") > \
        value(before, "jaxserve:engine_steps", "_total")


def test_cache_config_and_request_parameter_families(server):
    before = scrape(server.url)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    r = client.completions.create(model=MODEL_NAME, prompt="w20 w21 w22", n=2, max_tokens=7,
                                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    client.completions.create(model=MODEL_NAME, prompt="w30 w31 w32 w33 w34", max_tokens=4,
                              temperature=0, extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def delta(name: str, suffix: str) -> float:
        return value(after, name, suffix) - value(before, name, suffix)

    assert delta("vllm:request_params_n", "_count") == 2
    assert delta("vllm:request_params_n", "_sum") == 2 + 1
    assert delta("vllm:request_params_max_tokens", "_sum") == 7 + 4
    assert delta("vllm:request_max_num_generation_tokens", "_sum") == 7 + 4
    # every token computed lands in exactly one step: each sample's prompt (shorter than
    # a block: nothing prefix-cached) and one decode row per generated token but the last
    steps = delta("vllm:iteration_tokens_total", "_count")
    assert 4 <= steps <= delta("jaxserve:engine_steps", "_total")
    assert delta("vllm:iteration_tokens_total", "_sum") == (2 * 3 + 5) + (2 * 6 + 3)
    kind, samples = after["vllm:cache_config_info"]
    assert kind == "gauge" and len(samples) == 1 and samples[0].value == 1
    labels = samples[0].labels
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "64"
    assert labels["cache_dtype"] == "auto" and labels["enable_prefix_caching"] == "True"
    assert labels["engine"] == "0" and labels["num_gpu_blocks_override"] == "64"


def _snapshot() -> dict:
    return dict(num_running=2, num_waiting=1, kv_usage=0.25, prefix_queries=10,
                prefix_hits=4, num_preemptions=1, num_compiles=3, steps=7, errored=False)


def test_jaxserve_names_have_the_same_histograms():
    m = ServerMetrics("m", _snapshot, max_model_len=64)
    m.observe_request(prompt_tokens=5, generation_tokens=4, finish_reasons=["stop"],
                      ttft=0.5, itls=[0.1, 0.2, 0.3], e2e=1.2, queue_time=0.2)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert not any(n.startswith("vllm:") for n in fams)

    def one(name: str, suffix: str) -> float:
        [v] = [s.value for s in fams[name].samples if s.name == name + suffix]
        return v
    p = "jaxserve:"
    assert one(p + "request_queue_time_seconds", "_sum") == pytest.approx(0.2)
    assert one(p + "request_prefill_time_seconds", "_sum") == pytest.approx(0.3)
    assert one(p + "request_decode_time_seconds", "_sum") == pytest.approx(0.6)
    assert one(p + "request_inference_time_seconds", "_sum") == pytest.approx(0.9)
    assert one(p + "request_time_per_output_token_seconds", "_sum") == pytest.approx(0.2)
    assert one(p + "inter_token_latency_seconds", "_count") == 3
    assert one(p + "request_prompt_tokens", "_sum") == 5
    assert one(p + "request_generation_tokens", "_sum") == 4
    assert fams[p + "kv_cache_usage_perc"].samples[0].value == 0.25
    assert fams[p + "prefix_cache_hit_rate"].samples[0].value == pytest.approx(0.4)
    assert fams[p + "request_success"].type == "counter"
    les = [s.labels["le"] for s in fams[p + "request_prompt_tokens"].samples
           if s.name.endswith("_bucket")]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]


def test_request_that_never_ran_skips_phase_histograms():
    m = ServerMetrics("m", _snapshot, compat="vllm")
    m.observe_request(prompt_tokens=5, generation_tokens=0, finish_reasons=["abort"],
                      ttft=None, itls=[], e2e=0.05, queue_time=None)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}

    def count(name: str) -> float:
        [v] = [s.value for s in fams[name].samples if s.name == name + "_count"]
        return v
    assert count("vllm:e2e_request_latency_seconds") == 1
    for name in ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"):
        assert count(name) == 0, name


def test_bad_compat_mode_is_refused():
    from jaxserve.config import ConfigError, EngineArgs
    with pytest.raises(ConfigError, match="metrics_compat"):
        EngineArgs(metrics_compat="tgi")
