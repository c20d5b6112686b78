"""The server's Prometheus metrics (`/metrics`): requests by route and status, per-request latencies
(time to first token, inter-token latency, end to end), the engine's counters, queue and cache usage, and
speculative decoding's acceptance. One registry per server, so several can live in one process."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)
"""Seconds: time to first token, from a request's arrival (tokenizing and waiting included)."""
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
"""Seconds: time between consecutive output tokens of one request."""
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
"""Seconds: a request's arrival to its last token."""
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
"""Tokens per request (prompt, or generated)."""
ENGINE_COUNTERS = {"steps": "Model steps run", "graph_steps": "Model steps that replayed a CUDA graph",
                   "prompt_tokens": "Prompt tokens admitted", "generated_tokens": "Tokens generated",
                   "preemptions": "Requests preempted when the cache ran out (recomputed later)"}
"""The engine's `stats` counters the metrics expose, with their help text."""
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
"""Paths counted under their own name; `/v1/models/<id>` counts as one route, anything else as `other`."""


def route_of(path: str) -> str:
    """The route label of a request path (bounded, whatever clients send)."""
    if path in ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


class ServerMetrics:
    """The metrics of one server over `engine` (an AsyncLLM); `admitted()` counts requests the server holds."""

    def __init__(self, engine, admitted) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("glm5next_http_requests", "HTTP requests answered, by route and status code",
                                     ["route", "status"], registry=r)
        self.ttft = Histogram("glm5next_time_to_first_token_seconds", "Time from a request's arrival to its first "
                              "generated token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("glm5next_inter_token_latency_seconds", "Time between consecutive generated tokens of "
                             "a request", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("glm5next_e2e_request_latency_seconds", "Time from a request's arrival to its last "
                             "token", buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("glm5next_request_prompt_tokens", "Prompt tokens per request",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("glm5next_request_generation_tokens", "Generated tokens per request",
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.finished = Counter("glm5next_requests_finished", "Generation requests ended, by finish reason "
                                "(stop, length, abort)", ["reason"], registry=r)
        r.register(_EngineCollector(engine, admitted))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Latencies of one generation request, fed each time its output grows."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics, self.arrival = metrics, arrival
        self.last: float | None = None
        self.tokens = 0

    def grew(self, tokens: int) -> None:
        """The output now holds `tokens` tokens."""
        new = tokens - self.tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
            new -= 1
        elif new:  # tokens that came together (a speculative step) share the gap
            gap = (now - self.last) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self.last, self.tokens = now, tokens

    def finished(self, reason: str, prompt_tokens: int) -> None:
        """The request ended with `reason`."""
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.arrival)
        m.finished.labels(reason).inc()
        m.prompt_tokens.observe(prompt_tokens)
        m.generation_tokens.observe(self.tokens)


class _EngineCollector:
    """The engine's counters and gauges, read when scraped."""

    def __init__(self, engine, admitted) -> None:
        self.engine, self.admitted = engine, admitted

    def collect(self):
        core = self.engine.engine
        stats = dict(core.stats)
        for key, help_text in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"glm5next_{key}", help_text, value=stats.get(key, 0))
        use = self.engine.usage()
        yield GaugeMetricFamily("glm5next_requests_running", "Requests in the running batch", value=use["running"])
        yield GaugeMetricFamily("glm5next_requests_waiting", "Requests waiting for the running batch",
                                value=use["waiting"])
        yield GaugeMetricFamily("glm5next_cache_usage", "Fraction of paged-cache blocks in use (0 to 1)",
                                value=use["cache_usage"])
        yield GaugeMetricFamily("glm5next_server_requests", "Generation requests the server holds (tokenizing, "
                                "waiting or running); more than --max-concurrent-requests are refused",
                                value=self.admitted())
        if not core.spec:
            return
        m = core.spec_metrics()
        yield CounterMetricFamily("glm5next_spec_draft_tokens", "Speculative tokens drafted", value=stats["drafted"])
        yield CounterMetricFamily("glm5next_spec_accepted_tokens", "Speculative tokens accepted",
                                  value=stats["accepted"])
        yield GaugeMetricFamily("glm5next_spec_acceptance_rate", "Accepted over drafted speculative tokens",
                                value=m["acceptance_rate"])
        yield GaugeMetricFamily("glm5next_spec_mean_accepted_length", "Tokens per verify step, the bonus token "
                                "included", value=m["mean_accepted_length"])
        by_position = GaugeMetricFamily("glm5next_spec_acceptance_by_position", "Acceptance rate at each draft "
                                        "position", labels=["position"])
        for i, a in enumerate(m["acceptance_by_position"]):
            by_position.add_metric([str(i)], a)
        yield by_position
