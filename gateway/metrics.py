"""Prometheus metrics of the gateway, in their own ``CollectorRegistry`` (served on ``/metrics``).

Counters and histograms the request path updates live here; what admission and the worker pool already count
(queue depths, admitted / rejected totals, pressure level, breaker states, worker readiness and KV statistics) is
read from their snapshots at scrape time by :class:`StateCollector`, so the two never disagree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.admission.stats import AdmissionStats
from gateway.loop_metrics import LoopCounterFamily, LoopHistogramFamily, LoopMetricsCollector
from gateway.workers.status import WorkerStatus
from shared.protocol import KV_STAT_COUNTERS, Capacity

if TYPE_CHECKING:  # gateway.jobs imports gateway.state, which imports this module
    from gateway.jobs.models import JobsSummary

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_OVERHEAD_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
PRESSURE_LEVEL_VALUES = {"normal": 0, "elevated": 1, "critical": 2}
BREAKER_STATE_VALUES = {"closed": 0, "half_open": 1, "open": 2}
_KV_STAT_KEY = re.compile(r"^(?P<name>[^{]+)(?:\{(?P<labels>.*)\})?$")
_INVALID_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")
_OWN_KV_SUFFIXES = frozenset({"usage", "blocks_used"})  # sluice_worker_kv_usage / _blocks_used are the gateway's


class Metrics:
    """All gateway metrics; one instance per app.

    The per-request counters and histograms are loop-owned (:mod:`gateway.loop_metrics`: no lock, updated only on
    the event loop's thread).

    Attributes (Prometheus names):
        requests: ``sluice_requests_total{endpoint,status}``.
        ttft: ``sluice_ttft_seconds`` time from request arrival to the first output token sent.
        inter_token_latency: ``sluice_inter_token_latency_seconds`` gap between token batches of one choice.
        e2e_latency: ``sluice_e2e_latency_seconds`` request arrival to last byte.
        prompt_tokens, completion_tokens: ``sluice_prompt_tokens_total``, ``sluice_completion_tokens_total``.
        gateway_overhead: ``sluice_gateway_overhead_seconds`` = gateway TTFT − worker time to first token.
        num_active_requests: ``sluice_active_requests`` requests being served now (``active_streams`` of the
            cases), read at scrape time.
        unfinished_request_bodies: ``sluice_unfinished_request_bodies`` request bodies being received now (a
            slow-body attack shows here; ``gateway.max_unfinished_bodies`` bounds it).
        worker_kv_usage: ``sluice_worker_kv_usage{worker}`` used / total KV blocks.
        worker_kv_blocks_used: ``sluice_worker_kv_blocks_used{worker}``.
        worker_running: ``sluice_worker_requests_running{worker}``; worker_waiting likewise.
        queue_time: ``sluice_queue_time_seconds{tier}`` arrival → admission of each admitted choice.
        jobs: ``sluice_jobs{status}`` jobs in the store by status (queued, running, succeeded, failed, cancelled,
            expired; finished ones until their retention ends), set by :meth:`observe_jobs` on every scrape.
        jobs_oldest_queued_age: ``sluice_jobs_oldest_queued_age_seconds`` wait of the oldest queued job.
        batches_in_progress: ``sluice_batches_in_progress`` batches not in a final status.
        jobs_finished: ``sluice_jobs_finished_total{status}`` jobs this gateway's runner ran to ``succeeded`` or
            ``failed`` since it started.

    Read at scrape time (:class:`StateCollector`, once :meth:`attach_state` is called):
    ``sluice_pressure_level`` (0 normal, 1 elevated, 2 critical), ``sluice_queue_depth{tier}``,
    ``sluice_queue_oldest_wait_seconds{tier}``, ``sluice_admitted_total{tier}``, ``sluice_rejected_total{tier,reason}``,
    ``sluice_deferred_total{tier,reason}`` (shed, then served as an async job: not in ``sluice_rejected_total``),
    ``sluice_cancelled_total{tier}`` (left the queue: client gone), ``sluice_preempted_total{tier}`` (stopped for a
    higher tier on an upstream engine, to resume), ``sluice_drain_rate_tokens_per_second``,
    ``sluice_breaker_state{worker,backend}`` (0 closed, 1 half-open, 2 open), ``sluice_worker_ready{worker,backend}``,
    ``sluice_worker_info{worker,backend,device,model}``, ``sluice_worker_decode_tokens_per_second{worker,backend}``,
    ``sluice_worker_prefill_tokens_per_second{worker,backend}`` and ``sluice_worker_kv_<key>{worker,backend,...}``
    for each entry of the worker's ``Capacity.kv_stats`` (a counter ``…_<key>_total`` for the totals of
    ``shared.protocol.KV_STAT_COUNTERS``). ``backend="sim"`` marks the roofline simulator.

    The gateway process itself: prometheus-client's ``process_*`` metrics (``process_cpu_seconds_total``,
    ``process_resident_memory_bytes``, ``process_open_fds``, …; Linux only) — what a leak or a spinning loop shows in.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.num_active_requests = 0
        r = self.registry
        ProcessCollector(registry=r)
        self.requests = LoopCounterFamily("sluice_requests", "HTTP requests by endpoint and status",
                                          ["endpoint", "status"])
        self.ttft = LoopHistogramFamily("sluice_ttft_seconds", "Time to first token", _LATENCY_BUCKETS_S)
        self.inter_token_latency = LoopHistogramFamily("sluice_inter_token_latency_seconds",
                                                       "Gap between output tokens", _ITL_BUCKETS_S)
        self.e2e_latency = LoopHistogramFamily("sluice_e2e_latency_seconds", "Request arrival to last byte",
                                               _LATENCY_BUCKETS_S)
        self.prompt_tokens = LoopCounterFamily("sluice_prompt_tokens", "Prompt tokens served")
        self.completion_tokens = LoopCounterFamily("sluice_completion_tokens", "Completion tokens served")
        self.gateway_overhead = LoopHistogramFamily("sluice_gateway_overhead_seconds",
                                                    "Gateway TTFT minus the worker's time to first token",
                                                    _OVERHEAD_BUCKETS_S)
        self.queue_time = LoopHistogramFamily("sluice_queue_time_seconds",
                                              "Arrival to admission of admitted requests", _QUEUE_BUCKETS_S, ["tier"])
        r.register(LoopMetricsCollector((self.requests, self.ttft, self.inter_token_latency, self.e2e_latency,
                                         self.prompt_tokens, self.completion_tokens, self.gateway_overhead,
                                         self.queue_time)))
        r.register(_ActiveRequestsCollector(self))
        self.unfinished_request_bodies = Gauge("sluice_unfinished_request_bodies", "Request bodies being received",
                                               registry=r)
        self.worker_kv_usage = Gauge("sluice_worker_kv_usage", "Used / total KV blocks", ["worker"], registry=r)
        self.worker_kv_blocks_used = Gauge("sluice_worker_kv_blocks_used", "KV blocks held by sequences",
                                           ["worker"], registry=r)
        self.worker_running = Gauge("sluice_worker_requests_running", "Sequences running on the worker",
                                    ["worker"], registry=r)
        self.worker_waiting = Gauge("sluice_worker_requests_waiting", "Sequences waiting in the worker",
                                    ["worker"], registry=r)
        self.jobs = Gauge("sluice_jobs", "Jobs in the job store by status", ["status"], registry=r)
        self.jobs_oldest_queued_age = Gauge("sluice_jobs_oldest_queued_age_seconds",
                                            "Wait of the oldest queued job", registry=r)
        self.batches_in_progress = Gauge("sluice_batches_in_progress", "Batches not in a final status", registry=r)
        self.jobs_finished = Counter("sluice_jobs_finished", "Jobs this gateway's runner finished, by status",
                                     ["status"], registry=r)
        self._state_collector: StateCollector | None = None
        self._worker_gauges: dict[str, tuple[Gauge, Gauge, Gauge, Gauge]] = {}

    def attach_state(self, admission_stats: Callable[[], AdmissionStats],
                     worker_status: Callable[[], list[WorkerStatus]]) -> None:
        """Export admission and worker state read at scrape time (call once the app's resources exist)."""
        if self._state_collector is None:
            self._state_collector = StateCollector(admission_stats, worker_status)
            self.registry.register(self._state_collector)

    def request_started(self) -> None:
        """Count a request as active (``sluice_active_requests``, read at scrape time)."""
        self.num_active_requests += 1

    def request_ended(self) -> None:
        """Count an active request as done."""
        self.num_active_requests -= 1

    def observe_capacity(self, worker: str, capacity: Capacity) -> None:
        """Record a worker's capacity report."""
        gauges = self._worker_gauges.get(worker)
        if gauges is None:  # a labels() lookup costs more than the set: once per worker
            gauges = self._worker_gauges[worker] = (
                self.worker_kv_usage.labels(worker), self.worker_kv_blocks_used.labels(worker),
                self.worker_running.labels(worker), self.worker_waiting.labels(worker))
        usage, blocks_used, running, waiting = gauges
        usage.set(capacity.used_kv_blocks / (capacity.total_kv_blocks or 1))
        blocks_used.set(capacity.used_kv_blocks)
        running.set(capacity.num_running)
        waiting.set(capacity.num_waiting)

    def observe_jobs(self, summary: JobsSummary) -> None:
        """Set the job gauges from the store's summary (a status the store does not count is left out)."""
        for status in ("queued", "running", "succeeded", "failed", "cancelled", "expired"):
            count = getattr(summary, status)
            if count is not None:
                self.jobs.labels(status).set(count)
        if summary.oldest_queued_age_s is not None:
            self.jobs_oldest_queued_age.set(summary.oldest_queued_age_s)
        self.batches_in_progress.set(summary.batches_in_progress)

    def job_finished(self, status: str) -> None:
        """Count a job this gateway's runner finished (``succeeded`` or ``failed``)."""
        self.jobs_finished.labels(status).inc()

    def render(self) -> bytes:
        """Return the text exposition format of every metric."""
        return generate_latest(self.registry)


def _metric_name(raw: str) -> str:
    return _INVALID_NAME_CHARS.sub("_", raw.strip())


def parse_kv_stat_key(key: str) -> tuple[str, dict[str, str]]:
    """Split a ``Capacity.kv_stats`` key ``name`` or ``name{label=value,...}`` into a metric suffix and labels."""
    match = _KV_STAT_KEY.match(key)
    if match is None:
        return _metric_name(key), {}
    labels: dict[str, str] = {}
    for part in (match.group("labels") or "").split(","):
        label, sep, value = part.partition("=")
        if sep and label.strip():
            labels[_metric_name(label)] = value.strip().strip('"')
    return _metric_name(match.group("name")), labels


class _ActiveRequestsCollector:
    """``sluice_active_requests``: :attr:`Metrics.num_active_requests` read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily("sluice_active_requests", "Requests being served")
        gauge.add_metric([], self._metrics.num_active_requests)
        yield gauge


class StateCollector:
    """Prometheus collector that reads admission and worker snapshots at scrape time.

    Args:
        admission_stats: returns the admission stats (``Fleet.admission_stats``).
        worker_status: returns ``WorkerPool.status()``.
    """

    def __init__(self, admission_stats: Callable[[], AdmissionStats],
                 worker_status: Callable[[], list[WorkerStatus]]) -> None:
        self._admission_stats = admission_stats
        self._worker_status = worker_status

    def collect(self) -> Iterable[Metric]:
        """Yield the metric families (called by the registry on every scrape)."""
        yield from self._admission_metrics(self._admission_stats())
        yield from self._worker_metrics(self._worker_status())

    def _admission_metrics(self, stats: AdmissionStats) -> Iterable[Metric]:
        level = GaugeMetricFamily("sluice_pressure_level", "Pressure level: 0 normal, 1 elevated, 2 critical")
        level.add_metric([], PRESSURE_LEVEL_VALUES.get(stats.pressure.level, 0))
        yield level
        rate = GaugeMetricFamily("sluice_drain_rate_tokens_per_second",
                                 "Measured rate at which the workers work off queued tokens")
        rate.add_metric([], stats.drain_rate_tokens_per_s)
        yield rate
        depth = GaugeMetricFamily("sluice_queue_depth", "Requests waiting in the tier's admission queue",
                                  labels=["tier"])
        oldest = GaugeMetricFamily("sluice_queue_oldest_wait_seconds", "Wait of the oldest queued request",
                                   labels=["tier"])
        admitted = CounterMetricFamily("sluice_admitted", "Requests (choices) admitted to a worker", labels=["tier"])
        rejected = CounterMetricFamily("sluice_rejected", "Requests rejected or shed, by reason",
                                       labels=["tier", "reason"])
        deferred = CounterMetricFamily("sluice_deferred", "Requests shed and served as an async job instead (202)",
                                       labels=["tier", "reason"])
        cancelled = CounterMetricFamily("sluice_cancelled", "Queued requests whose client left", labels=["tier"])
        preempted = CounterMetricFamily("sluice_preempted", "Running requests stopped for a higher tier, to resume",
                                        labels=["tier"])
        for tier, tier_stats in stats.tiers.items():
            depth.add_metric([tier], tier_stats.queue_depth)
            oldest.add_metric([tier], tier_stats.oldest_wait_s)
            admitted.add_metric([tier], tier_stats.admitted)
            cancelled.add_metric([tier], tier_stats.cancelled)
            preempted.add_metric([tier], tier_stats.preempted)
            for reason, count in tier_stats.rejected.items():
                rejected.add_metric([tier, reason], count)
            for reason, count in tier_stats.deferred.items():
                deferred.add_metric([tier, reason], count)
        yield from (depth, oldest, admitted, rejected, deferred, cancelled, preempted)

    def _worker_metrics(self, workers: list[WorkerStatus]) -> Iterable[Metric]:
        ready = GaugeMetricFamily("sluice_worker_ready", "1 when the worker is connected and ready",
                                  labels=["worker", "backend"])
        breaker = GaugeMetricFamily("sluice_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open",
                                    labels=["worker", "backend"])
        info = GaugeMetricFamily("sluice_worker_info", "Worker identity (backend sim = roofline simulator)",
                                 labels=["worker", "backend", "device", "model"])
        decode = GaugeMetricFamily("sluice_worker_decode_tokens_per_second",
                                   "Worker decode rate per busy second (Capacity report)", labels=["worker", "backend"])
        prefill = GaugeMetricFamily("sluice_worker_prefill_tokens_per_second",
                                    "Worker prefill rate per busy second (Capacity report)",
                                    labels=["worker", "backend"])
        kv_families: dict[str, tuple[list[str], list[tuple[list[str], float]]]] = {}
        for worker in workers:
            backend = worker.backend
            ready.add_metric([worker.name, backend], 1.0 if worker.ready else 0.0)
            breaker.add_metric([worker.name, backend], BREAKER_STATE_VALUES[worker.breaker["state"]])
            hello = worker.hello
            if hello is not None:
                info.add_metric([worker.name, backend, hello["device"], hello["model_id"]], 1.0)
            capacity = worker.capacity or {}
            if capacity:
                decode.add_metric([worker.name, backend], capacity["decode_tokens_per_s"])
                prefill.add_metric([worker.name, backend], capacity["prefill_tokens_per_s"])
            for key, value in (capacity.get("kv_stats") or {}).items():
                suffix, labels = parse_kv_stat_key(key)
                if suffix in _OWN_KV_SUFFIXES:
                    suffix = f"stat_{suffix}"
                label_names, samples = kv_families.setdefault(suffix, (["worker", "backend"], []))
                for label in labels:
                    if label not in label_names:
                        label_names.append(label)
                samples.append(({"worker": worker.name, "backend": backend, **labels}, float(value)))
        yield from (ready, breaker, info, decode, prefill)
        for suffix, (label_names, samples) in kv_families.items():
            family_type = CounterMetricFamily if suffix in KV_STAT_COUNTERS else GaugeMetricFamily
            family = family_type(f"sluice_worker_kv_{suffix}",
                                 f"Worker KV statistic {suffix} (Capacity.kv_stats)", labels=label_names)
            for labels, value in samples:
                family.add_metric([labels.get(name, "") for name in label_names], value)
            yield family
