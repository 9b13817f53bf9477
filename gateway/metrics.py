"""Prometheus metrics of the gateway, in their own ``CollectorRegistry`` (served on ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.protocol import Capacity

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_OVERHEAD_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """All gateway metrics; one instance per app.

    Attributes (Prometheus names):
        requests: ``sluice_requests_total{endpoint,status}``.
        ttft: ``sluice_ttft_seconds`` time from request arrival to the first output token sent.
        inter_token_latency: ``sluice_inter_token_latency_seconds`` gap between token batches of one choice.
        e2e_latency: ``sluice_e2e_latency_seconds`` request arrival to last byte.
        prompt_tokens, completion_tokens: ``sluice_prompt_tokens_total``, ``sluice_completion_tokens_total``.
        gateway_overhead: ``sluice_gateway_overhead_seconds`` = gateway TTFT − worker time to first token.
        active_requests: ``sluice_active_requests`` requests being served now (``active_streams`` of the cases).
        worker_kv_usage: ``sluice_worker_kv_usage{worker}`` used / total KV blocks.
        worker_kv_blocks_used: ``sluice_worker_kv_blocks_used{worker}``.
        worker_running: ``sluice_worker_requests_running{worker}``; worker_waiting likewise.
        worker_ready: ``sluice_worker_ready{worker}`` 1 when connected and said Hello.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.num_active_requests = 0
        r = self.registry
        self.requests = Counter("sluice_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("sluice_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram("sluice_inter_token_latency_seconds", "Gap between output tokens",
                                             buckets=_ITL_BUCKETS_S, registry=r)
        self.e2e_latency = Histogram("sluice_e2e_latency_seconds", "Request arrival to last byte",
                                     buckets=_LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("sluice_prompt_tokens", "Prompt tokens served", registry=r)
        self.completion_tokens = Counter("sluice_completion_tokens", "Completion tokens served", registry=r)
        self.gateway_overhead = Histogram("sluice_gateway_overhead_seconds",
                                          "Gateway TTFT minus the worker's time to first token",
                                          buckets=_OVERHEAD_BUCKETS_S, registry=r)
        self.active_requests = Gauge("sluice_active_requests", "Requests being served", registry=r)
        self.worker_kv_usage = Gauge("sluice_worker_kv_usage", "Used / total KV blocks", ["worker"], registry=r)
        self.worker_kv_blocks_used = Gauge("sluice_worker_kv_blocks_used", "KV blocks held by sequences",
                                           ["worker"], registry=r)
        self.worker_running = Gauge("sluice_worker_requests_running", "Sequences running on the worker",
                                    ["worker"], registry=r)
        self.worker_waiting = Gauge("sluice_worker_requests_waiting", "Sequences waiting in the worker",
                                    ["worker"], registry=r)
        self.worker_ready = Gauge("sluice_worker_ready", "1 when the worker is connected and ready", ["worker"],
                                  registry=r)

    def request_started(self) -> None:
        """Count a request as active (``sluice_active_requests``)."""
        self.num_active_requests += 1
        self.active_requests.set(self.num_active_requests)

    def request_ended(self) -> None:
        """Count an active request as done."""
        self.num_active_requests -= 1
        self.active_requests.set(self.num_active_requests)

    def observe_capacity(self, worker: str, capacity: Capacity) -> None:
        """Record a worker's capacity report."""
        total = capacity.total_kv_blocks or 1
        self.worker_kv_usage.labels(worker).set(capacity.used_kv_blocks / total)
        self.worker_kv_blocks_used.labels(worker).set(capacity.used_kv_blocks)
        self.worker_running.labels(worker).set(capacity.num_running)
        self.worker_waiting.labels(worker).set(capacity.num_waiting)

    def render(self) -> bytes:
        """Return the text exposition format of every metric."""
        return generate_latest(self.registry)
