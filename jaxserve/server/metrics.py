"""Prometheus metrics: jaxserve's names, or vLLM's (`--metrics-compat vllm`).

    --metrics-compat jaxserve   jaxserve:<name>{model_name}            (the default)
    --metrics-compat vllm       vllm:<name>{model_name, engine="0"}    with vLLM's types
                                and buckets, so vLLM's Grafana dashboard and the Gateway
                                API Inference Extension read them unchanged

Both modes export the same measurements (vLLM's set: request counts by finish reason,
token counters, TTFT / ITL / TPOT / e2e / queue / prefill / decode / inference times,
prompt and generation lengths, running / waiting / KV usage / prefix cache /
preemptions, the request parameters n and max_tokens, the longest sample's length, tokens
per engine step, and the KV cache configuration as `cache_config_info`, value 1, its
settings as labels); vllm mode adds the deprecated aliases vLLM still serves
(time_per_output_token_seconds = ITL, gpu_cache_usage_perc). Metrics vLLM has no name
for (compiles, engine steps, health, prefix hit rate) stay `jaxserve:` in both modes.

Per-request histograms and counters are fed by the engine thread when a request
finishes (`observe_request`); gauges and engine counters are read from the engine's
snapshot at scrape time. Each server gets its own registry, so several servers can live
in one process (tests). Token counters move when a request finishes (vLLM's move per
step), so their rate lags by one request's duration.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COMPAT_MODES = ("jaxserve", "vllm")
FINISH_REASONS = ("stop", "length", "abort", "error")

# jaxserve's own buckets: finer at the low end than vLLM's (CPU and small models).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0)
# vLLM's (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def cache_info_labels(*, block_size: int, num_gpu_blocks: int, cache_dtype: str,
                      enable_prefix_caching: bool, gpu_memory_utilization: float,
                      num_gpu_blocks_override: int | None) -> dict[str, str]:
    """The labels of `cache_config_info`: vLLM's CacheConfig fields (as vLLM writes them,
    str() of the value) that have a meaning here."""
    return {"block_size": str(block_size), "cache_dtype": str(cache_dtype),
            "calculate_kv_scales": "False", "cpu_offload_gb": "0",
            "enable_prefix_caching": str(bool(enable_prefix_caching)),
            "gpu_memory_utilization": str(gpu_memory_utilization),
            "is_attention_free": "False", "num_cpu_blocks": "None",
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_gpu_blocks_override": str(num_gpu_blocks_override), "swap_space": "0"}


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (token-count histograms)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True, frozen=True)
class _Names:
    prefix: str
    labels: tuple[str, ...]
    values: tuple[str, ...]
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    e2e: tuple[float, ...]
    short: tuple[float, ...]      # queue and prefill times
    long: tuple[float, ...]       # decode and inference times
    aliases: bool                 # vLLM's deprecated names too


def _names(compat: str, model_name: str) -> _Names:
    if compat == "vllm":
        lat = VLLM_LATENCY_BUCKETS
        return _Names("vllm:", ("model_name", "engine"), (model_name, "0"), VLLM_TTFT_BUCKETS,
                      VLLM_ITL_BUCKETS, lat, lat, lat, True)
    if compat != "jaxserve":
        raise ValueError(f"metrics_compat must be one of {COMPAT_MODES}, got {compat!r}")
    return _Names("jaxserve:", ("model_name",), (model_name,), TTFT_BUCKETS, ITL_BUCKETS,
                  E2E_BUCKETS, TTFT_BUCKETS, E2E_BUCKETS, False)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]], *,
                 compat: str = "jaxserve", max_model_len: int = 2048,
                 cache_info: dict[str, str] | None = None, max_lora: int | None = None) -> None:
        """cache_info: the KV cache settings for `cache_config_info` (cache_info_labels);
        max_lora: --max-loras when LoRA adapters are served (`lora_requests_info`)."""
        n = self.names = _names(compat, model_name)
        self.registry = CollectorRegistry()
        r, ln, lv, p = self.registry, list(n.labels), n.values, n.prefix

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(p + name, doc, ln, buckets=buckets, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(p + name, doc, ln, registry=r).labels(*lv)

        success = Counter(p + "request_success", "finished requests by finish reason",
                          ln + ["finished_reason"], registry=r)
        # Every reason's series exists from the start (rate() needs a first sample).
        self._success, self._lv = success, lv
        self.requests = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "generated tokens")
        tok = buckets_1_2_5(max_model_len)
        self.prompt_len = hist("request_prompt_tokens", "prompt tokens per request", tok)
        self.generation_len = hist("request_generation_tokens", "generated tokens per request",
                                   tok)
        self.ttft = hist("time_to_first_token_seconds", "arrival to first token", n.ttft)
        self.itl = hist("inter_token_latency_seconds", "gap between a request's consecutive "
                        "token deliveries", n.itl)
        self.tpot = hist("request_time_per_output_token_seconds", "a request's mean time per "
                         "output token after the first", n.itl)
        self.tpot_alias = hist("time_per_output_token_seconds", "DEPRECATED in vLLM: the same "
                               "as inter_token_latency_seconds", n.itl) if n.aliases else None
        self.e2e = hist("e2e_request_latency_seconds", "arrival to finish", n.e2e)
        self.queue = hist("request_queue_time_seconds", "arrival to first scheduled (WAITING)",
                          n.short)
        self.prefill = hist("request_prefill_time_seconds", "first scheduled to first token",
                            n.short)
        self.decode = hist("request_decode_time_seconds", "first token to last token", n.long)
        self.inference = hist("request_inference_time_seconds", "first scheduled to last "
                              "token (RUNNING)", n.long)
        # vLLM's request-parameter and step histograms (vllm/v1/metrics/loggers.py)
        self.max_generation = hist("request_max_num_generation_tokens", "the most tokens "
                                   "one sample of a request generated", tok)
        self.params_n = hist("request_params_n", "the n request parameter", N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "the max_tokens request "
                                      "parameter (defaults filled)", tok)
        self.iteration_tokens = Histogram(p + "iteration_tokens_total", "tokens (prompt and "
                                          "generated) per engine step", ln,
                                          buckets=ITERATION_BUCKETS, registry=r).labels(*lv)
        if cache_info is not None:
            info = Gauge(p + "cache_config_info", "the KV cache configuration (value 1)",
                         list(cache_info) + ["engine"], registry=r)
            info.labels(*cache_info.values(), "0").set(1)
        self.registry.register(_EngineCollector(n, snapshot, max_lora))

    def observe_step(self, num_tokens: int) -> None:
        """One engine step ran num_tokens tokens (engine thread)."""
        self.iteration_tokens.observe(num_tokens)

    def observe_request(self, *, prompt_tokens: int, generation_tokens: int,
                        finish_reasons: list[str], ttft: float | None, itls: list[float],
                        e2e: float, queue_time: float | None = None, n: int = 1,
                        max_tokens: int | None = None, max_seq_tokens: int = 0) -> None:
        """One finished request (all its samples). queue_time: arrival to first
        scheduled, None if it never was; n and max_tokens: its parameters;
        max_seq_tokens: the tokens of its longest sample."""
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        self.max_generation.observe(max_seq_tokens)
        for reason in finish_reasons:
            c = self.requests.get(reason)
            if c is None:
                c = self.requests[reason] = self._success.labels(*self._lv, reason)
            c.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(generation_tokens)
        self.e2e.observe(e2e)
        for gap in itls:
            self.itl.observe(gap)
            if self.tpot_alias is not None:
                self.tpot_alias.observe(gap)
        # The gaps run from the first token to the last: their sum is the decode time.
        decode = sum(itls)
        if itls:
            self.tpot.observe(decode / len(itls))
        if queue_time is not None:
            self.queue.observe(queue_time)
        if ttft is None:
            return
        self.ttft.observe(ttft)
        self.decode.observe(decode)
        if queue_time is not None:
            prefill = max(ttft - queue_time, 0.0)
            self.prefill.observe(prefill)
            self.inference.observe(prefill + decode)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and engine-owned counters, read when Prometheus scrapes."""

    def __init__(self, names: _Names, snapshot: Callable[[], dict[str, Any]],
                 max_lora: int | None = None) -> None:
        self.names = names
        self.snapshot = snapshot
        self.max_lora = max_lora

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        s = self.snapshot()
        n = self.names
        p, ln, lv = n.prefix, list(n.labels), list(n.values)

        def gauge(name: str, doc: str, value: float, own: bool = False) -> GaugeMetricFamily:
            g = GaugeMetricFamily(("jaxserve:" if own else p) + name, doc,
                                  labels=["model_name"] if own else ln)
            g.add_metric(lv[:1] if own else lv, value)
            return g

        def counter(name: str, doc: str, value: float, own: bool = False
                    ) -> CounterMetricFamily:
            c = CounterMetricFamily(("jaxserve:" if own else p) + name, doc,
                                    labels=["model_name"] if own else ln)
            c.add_metric(lv[:1] if own else lv, value)
            return c

        yield gauge("num_requests_running", "requests in the running batch", s["num_running"])
        yield gauge("num_requests_waiting", "requests waiting to be scheduled",
                    s["num_waiting"])
        yield gauge("kv_cache_usage_perc", "fraction of KV blocks in use (0..1)", s["kv_usage"])
        if n.aliases:
            yield gauge("gpu_cache_usage_perc", "DEPRECATED in vLLM: the same as "
                        "kv_cache_usage_perc", s["kv_usage"])
        q, h = s["prefix_queries"], s["prefix_hits"]
        yield counter("prefix_cache_queries", "prompt tokens looked up", q)
        yield counter("prefix_cache_hits", "prompt tokens found cached", h)
        yield counter("num_preemptions", "requests preempted", s["num_preemptions"])
        # No vLLM name for these: jaxserve's in both modes.
        yield gauge("prefix_cache_hit_rate", "prefix cache hits / queries (tokens)",
                    h / q if q else 0.0, own=True)
        yield counter("num_compiles", "XLA compilations (flat after warm-up)",
                      s["num_compiles"], own=True)
        yield counter("engine_steps", "engine steps run", s["steps"], own=True)
        yield gauge("engine_healthy", "1 while the engine loop is alive and turning (0 once "
                    "it died or has not turned for --step-timeout s)",
                    0.0 if s["errored"] else 1.0, own=True)
        yield from _spec_metrics(s, counter, gauge, p, ln, lv)
        yield from _offload_metrics(s, counter, p, ln, lv)
        if self.max_lora is not None:
            # vLLM's: the adapters of running and waiting requests as labels (names
            # comma-joined), the value the time of the scrape
            info = GaugeMetricFamily(p + "lora_requests_info", "LoRA adapters of the "
                                     "running and waiting requests",
                                     labels=["max_lora", "waiting_lora_adapters",
                                             "running_lora_adapters"])
            info.add_metric([str(self.max_lora), ",".join(s.get("waiting_loras", ())),
                             ",".join(s.get("running_loras", ()))], time.time())
            yield info


def _offload_metrics(s: dict[str, Any], counter: Callable, prefix: str,
                     labels: list[str], values: list[str]) -> Iterator[Any]:
    """KV offload tiers. vLLM's external_prefix_cache_* count the tokens its KV
    connectors (the CPU offloading one among them) are asked for and find; here that is
    the host and disk tiers together. Per tier and per direction: jaxserve's names."""
    yield counter("external_prefix_cache_queries", "prompt tokens looked up in the KV "
                  "offload tiers (past the device prefix-cache hits)",
                  s.get("offload_host_queries", 0))
    yield counter("external_prefix_cache_hits", "of those, tokens found in host memory or "
                  "on disk", s.get("offload_host_hits", 0) + s.get("offload_disk_hits", 0))
    lv = values[:1]
    queries = CounterMetricFamily("jaxserve:kv_offload_queries", "prompt tokens looked up "
                                  "in a tier (past the faster tiers' hits)",
                                  labels=["model_name", "tier"])
    hits = CounterMetricFamily("jaxserve:kv_offload_hits", "prompt tokens found in a tier",
                               labels=["model_name", "tier"])
    for tier, q, h in (("device", s.get("prefix_queries", 0), s.get("prefix_hits", 0)),
                       ("host", s.get("offload_host_queries", 0),
                        s.get("offload_host_hits", 0)),
                       ("disk", s.get("offload_disk_queries", 0),
                        s.get("offload_disk_hits", 0))):
        queries.add_metric(lv + [tier], q)
        hits.add_metric(lv + [tier], h)
    yield queries
    yield hits
    moved = CounterMetricFamily("jaxserve:kv_offload_bytes", "KV bytes copied between "
                                "tiers", labels=["model_name", "direction"])
    for direction, key in (("device_to_host", "offload_bytes_to_host"),
                           ("host_to_device", "offload_bytes_to_device"),
                           ("host_to_disk", "offload_bytes_to_disk"),
                           ("disk_to_host", "offload_bytes_from_disk")):
        moved.add_metric(lv + [direction], s.get(key, 0))
    yield moved
    held = GaugeMetricFamily("jaxserve:kv_offload_used_bytes", "KV bytes a tier holds now",
                             labels=["model_name", "tier"])
    held.add_metric(lv + ["host"], s.get("offload_host_bytes", 0))
    held.add_metric(lv + ["disk"], s.get("offload_disk_bytes", 0))
    yield held


def _spec_metrics(s: dict[str, Any], counter: Callable, gauge: Callable, prefix: str,
                  labels: list[str], values: list[str]) -> Iterator[Any]:
    """Speculative decoding (vLLM's spec_decode_* counters; rates are jaxserve's)."""
    drafts, tokens, accepted = (s.get("spec_drafts", 0), s.get("spec_draft_tokens", 0),
                                s.get("spec_accepted_tokens", 0))
    yield counter("spec_decode_num_drafts", "request rows that verified proposals", drafts)
    yield counter("spec_decode_num_draft_tokens", "proposed tokens verified", tokens)
    yield counter("spec_decode_num_accepted_tokens", "proposed tokens accepted", accepted)
    per_pos = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                  "proposed tokens accepted at each position",
                                  labels=labels + ["position"])
    for i, v in enumerate(s.get("spec_accepted_per_pos", ())):
        per_pos.add_metric(values + [str(i)], v)
    yield per_pos
    yield gauge("spec_decode_acceptance_rate", "accepted / proposed tokens",
                accepted / tokens if tokens else 0.0, own=True)
    yield gauge("spec_decode_mean_accepted_length", "tokens emitted per speculating row "
                "and step (1 + accepted / drafts)", 1 + accepted / drafts if drafts else 0.0,
                own=True)
