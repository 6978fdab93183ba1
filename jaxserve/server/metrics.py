"""Prometheus metrics (vLLM's names under the `jaxserve:` prefix).

Per-request histograms and counters are fed by the engine thread when a request
finishes (`observe_request`); gauges are read from the engine at scrape time. Each
server gets its own registry, so several servers can live in one process (tests).
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r, ln = self.registry, ["model_name"]
        self.requests = Counter("jaxserve:request_success", "finished requests by finish reason",
                                ln + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "prompt tokens of finished "
                                     "requests", ln, registry=r).labels(**labels)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "generated tokens",
                                         ln, registry=r).labels(**labels)
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "time to first token",
                              ln, buckets=TTFT_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds", "gap between a request's "
                             "consecutive token deliveries", ln, buckets=ITL_BUCKETS,
                             registry=r).labels(**labels)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "arrival to finish", ln,
                             buckets=E2E_BUCKETS, registry=r).labels(**labels)
        self._model_name = model_name
        self.registry.register(_EngineCollector(model_name, snapshot))

    def observe_request(self, *, prompt_tokens: int, generation_tokens: int,
                        finish_reasons: list[str], ttft: float | None, itls: list[float],
                        e2e: float) -> None:
        for reason in finish_reasons:
            self.requests.labels(model_name=self._model_name, finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        for gap in itls:
            self.itl.observe(gap)
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and engine-owned counters, read when Prometheus scrapes."""

    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot

    def describe(self) -> list:
        return []

    def collect(self):
        s = self.snapshot()
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("jaxserve:num_requests_running", "requests in the running batch",
                    s["num_running"])
        yield gauge("jaxserve:num_requests_waiting", "requests waiting to be scheduled",
                    s["num_waiting"])
        yield gauge("jaxserve:kv_cache_usage_perc", "fraction of KV blocks in use (0..1)",
                    s["kv_usage"])
        q, h = s["prefix_queries"], s["prefix_hits"]
        yield gauge("jaxserve:prefix_cache_hit_rate", "prefix cache hits / queries (tokens)",
                    h / q if q else 0.0)
        yield counter("jaxserve:prefix_cache_queries", "prompt tokens looked up", q)
        yield counter("jaxserve:prefix_cache_hits", "prompt tokens found cached", h)
        yield counter("jaxserve:num_preemptions", "requests preempted", s["num_preemptions"])
        yield counter("jaxserve:num_compiles", "XLA compilations (flat after warm-up)",
                      s["num_compiles"])
        yield counter("jaxserve:engine_steps", "engine steps run", s["steps"])
        yield gauge("jaxserve:engine_healthy", "1 while the engine loop is alive",
                    0.0 if s["errored"] else 1.0)
