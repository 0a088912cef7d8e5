"""The PD router's own Prometheus metrics (GET /metrics on the router's port), one registry per app.

sparkrelay_router:requests_total{route, status}   answered generation requests, by HTTP status
sparkrelay_router:errors_total{route, side}       failed requests by the side that failed (prefill, decode, router)
sparkrelay_router:retries_total{route}            attempts repeated with a new room after a retryable failure
sparkrelay_router:upstream_attempts_total{route}  (prefill, decode) pairs tried, first attempts included
sparkrelay_router:request_latency_seconds{route}  arrival to the last byte relayed (streams included)
sparkrelay_router:active_requests                 requests being routed (until their answer starts)
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "sparkrelay_router:"
        self.requests = Counter(
            p + "requests",
            "Generation requests answered, by route and HTTP status.",
            ["route", "status"],
            registry=r,
        )
        self.errors = Counter(
            p + "errors",
            "Failed generation requests, by the side that failed.",
            ["route", "side"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Retries with a new room after a retryable failure.",
            ["route"],
            registry=r,
        )
        self.attempts = Counter(
            p + "upstream_attempts", "(prefill, decode) pairs tried.", ["route"], registry=r
        )
        self.latency = Histogram(
            p + "request_latency_seconds",
            "Arrival to the last byte relayed.",
            ["route"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.active = Gauge(
            p + "active_requests",
            "Generation requests being routed (until their answer starts).",
            registry=r,
        )

    def finished(self, route: str, status: int, seconds: float, failed_side: str = "") -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if failed_side:
            self.errors.labels(route, failed_side).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
