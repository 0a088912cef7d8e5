"""Prometheus metrics, named like SGLang's (`sglang:` -> `sparkrelay:`).

Each app gets its own CollectorRegistry so several servers (or tests) can live in one process.
Gauges of engine state are refreshed from the engine thread's stats snapshot at scrape time.
"""

from __future__ import annotations

import time
from typing import Optional

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from sparkrelay.scheduler.request import RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "sparkrelay:"
        self.num_requests = Counter(
            p + "num_requests", "Finished engine requests.", ["finish_reason"], registry=r
        )
        self.num_bad_requests = Counter(
            p + "num_bad_requests", "HTTP requests answered with a 4xx.", registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            p + "cached_tokens",
            "Prompt tokens of finished requests found in the prefix cache.",
            registry=r,
        )
        self.cache_hit_rate = Gauge(
            p + "cache_hit_rate",
            "Prefix cache hit rate: prompt tokens found in the cache / "
            "prompt tokens looked up, since start.",
            registry=r,
        )
        self.prefix_cache_tokens = Gauge(
            p + "prefix_cache_tokens",
            "KV cache tokens the prefix cache holds (in use by requests or evictable).",
            registry=r,
        )
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.num_running = Gauge(
            p + "num_running_reqs", "Requests in the running batch.", registry=r
        )
        self.num_waiting = Gauge(
            p + "num_queue_reqs", "Requests waiting to be scheduled.", registry=r
        )
        self.kv_usage = Gauge(p + "token_usage", "Fraction of KV cache tokens in use.", registry=r)
        self.kv_used = Gauge(p + "kv_used_tokens", "KV cache tokens in use.", registry=r)
        self.kv_total = Gauge(p + "kv_total_tokens", "KV cache capacity in tokens.", registry=r)
        self.spec_accept_length = Gauge(
            p + "spec_accept_length",
            "Committed tokens per speculative verify round (tau), server-wide.",
            registry=r,
        )
        self.spec_verify_rate = Gauge(
            p + "spec_verify_rate",
            "Committed tokens / tokens sent to the target in verify rounds.",
            registry=r,
        )
        self.spec_rounds = Gauge(
            p + "spec_verify_rounds", "Speculative verify rounds so far.", registry=r
        )
        self.spec_plain_steps = Gauge(
            p + "spec_plain_steps",
            "Decode steps run without drafting (--speculative-disable-by-batch-size).",
            registry=r,
        )
        self.spec_accept_rate = Gauge(
            p + "spec_accept_rate",
            "Per draft position: rounds whose accepted prefix "
            "reached it / rounds that proposed it.",
            ["position"],
            registry=r,
        )

    def render(self, stats: dict) -> bytes:
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        self.kv_used.set(stats.get("kv_used_tokens", 0))
        self.kv_total.set(stats.get("kv_total_tokens", 0))
        self.cache_hit_rate.set(stats.get("cache_hit_rate", 0.0))
        self.prefix_cache_tokens.set(stats.get("prefix_cache_tokens", 0))
        if "spec_rounds" in stats:
            self.spec_rounds.set(stats["spec_rounds"])
            self.spec_accept_length.set(stats["spec_accept_length"])
            self.spec_verify_rate.set(stats["spec_verify_rate"])
            self.spec_plain_steps.set(stats["spec_plain_steps"])
            for k, rate in enumerate(stats["spec_accept_rate_per_position"]):
                self.spec_accept_rate.labels(position=str(k)).set(rate)
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Timing of one engine request: feed it every output of that request."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.arrival = time.perf_counter()
        self.last_token: Optional[float] = None

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        n = len(out.new_ids)
        if n:
            if self.last_token is None:
                self.m.ttft.observe(now - self.arrival)
            else:
                self.m.itl.observe((now - self.last_token) / n)
            self.last_token = now
            self.m.generation_tokens.inc(n)
        if out.finished:
            reason = (out.finish_reason or {}).get("type", "unknown")
            self.m.num_requests.labels(finish_reason=reason).inc()
            self.m.prompt_tokens.inc(out.prompt_tokens)
            self.m.cached_tokens.inc(out.cached_tokens)
            self.m.e2e.observe(now - self.arrival)
