"""The router's own Prometheus metrics (GET /metrics on the router).

    jaxserve_router:backend_requests_total{backend}          attempts sent to a backend
    jaxserve_router:backend_retries_total{backend}           attempts that were retries
                                                             (labelled with where they went)
    jaxserve_router:backend_failures_total{backend, kind}    connect | disconnect | timeout |
                                                             status | mid_stream
    jaxserve_router:requests_failed_total{reason}            requests answered with an
                                                             error by the router itself
    jaxserve_router:backend_healthy{backend}                 1 up, 0 down
    jaxserve_router:backend_inflight{backend}                requests open on it now
    jaxserve_router:backend_reported_load{backend}           its last running + waiting
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from jaxserve.router.backends import BackendPool

P = "jaxserve_router:"
FAILURE_KINDS = ("connect", "disconnect", "timeout", "status", "mid_stream")


class RouterMetrics:
    def __init__(self, pool: BackendPool) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(P + "backend_requests", "attempts sent to a backend",
                                ["backend"], registry=r)
        self.retries = Counter(P + "backend_retries", "attempts that retried a request "
                               "another backend failed before its first token", ["backend"],
                               registry=r)
        self.failures = Counter(P + "backend_failures", "failed attempts by kind",
                                ["backend", "kind"], registry=r)
        self.failed = Counter(P + "requests_failed", "requests the router answered with an "
                              "error (no backend left, or a stream cut after its start)",
                              ["reason"], registry=r)
        for b in pool.backends:         # every series exists from the start
            self.requests.labels(b.url)
            self.retries.labels(b.url)
            for kind in FAILURE_KINDS:
                self.failures.labels(b.url, kind)
        r.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        specs = (("backend_healthy", "1 while the backend passes its health checks",
                  lambda b: 1.0 if b.healthy else 0.0),
                 ("backend_inflight", "requests this router has open on the backend",
                  lambda b: float(b.inflight)),
                 ("backend_reported_load", "running + waiting from the backend's /metrics "
                  "(least_load only)", lambda b: b.reported))
        for name, doc, value in specs:
            g = GaugeMetricFamily(P + name, doc, labels=["backend"])
            for b in self.pool.backends:
                g.add_metric([b.url], value(b))
            yield g
