"""The loop-owned counters and histograms expose what prometheus-client's own would for the same updates."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.loop_metrics import LoopCounterFamily, LoopHistogramFamily, LoopMetricsCollector

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the ``_created`` ones (prometheus-client's own; the loop-owned metrics have none)."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_histograms_and_counters_expose_the_same_samples_as_prometheus_client():
    rng = random.Random(7)
    values = [rng.choice([0.0, 0.001, 0.005, 2.5, 3.0]) if rng.random() < 0.2 else rng.expovariate(20.0)
              for _ in range(2000)]  # bucket bounds themselves (le is inclusive) and values past the last bound
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    latency = LoopHistogramFamily("x_latency_seconds", "latency", BUCKETS)
    by_tier = LoopHistogramFamily("x_queue_seconds", "queue", BUCKETS, ["tier"])
    requests = LoopCounterFamily("x_requests", "requests", ["endpoint", "status"])
    tokens = LoopCounterFamily("x_tokens", "tokens")
    ours.register(LoopMetricsCollector((latency, by_tier, requests, tokens)))
    ref_latency = Histogram("x_latency_seconds", "latency", buckets=BUCKETS, registry=theirs)
    ref_by_tier = Histogram("x_queue_seconds", "queue", ["tier"], buckets=BUCKETS, registry=theirs)
    ref_requests = Counter("x_requests", "requests", ["endpoint", "status"], registry=theirs)
    ref_tokens = Counter("x_tokens", "tokens", registry=theirs)
    for i, value in enumerate(values):
        tier = ("vip", "free")[i % 2]
        status = ("200", "429", "503")[i % 3]
        latency.observe(value)
        ref_latency.observe(value)
        by_tier.labels(tier).observe(value)
        ref_by_tier.labels(tier).observe(value)
        requests.labels("/v1/chat/completions", status).inc()
        ref_requests.labels("/v1/chat/completions", status).inc()
        tokens.inc(i % 5)
        ref_tokens.inc(i % 5)
    got, want = _samples(ours), _samples(theirs)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert got[("x_latency_seconds_count", ())] == len(values)


def test_a_labelled_family_refuses_the_wrong_number_of_label_values():
    family = LoopHistogramFamily("x_seconds", "x", BUCKETS, ["tier"])
    with pytest.raises(ValueError, match="takes labels"):
        family.labels("vip", "extra")
