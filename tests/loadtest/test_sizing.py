"""Sizing a replay to the gateway's measured capacity (loadtest/sizing.py)."""

from __future__ import annotations

import pytest

from loadtest.sizing import MeasuredCapacity, WorkerRates, capacity_from_status, rate_scale_for
from loadtest.traces import TraceRequest


def status_of(*capacities: dict) -> dict:
    return {"workers": [{"name": f"w{i}", "capacity": c} for i, c in enumerate(capacities)]}


def test_capacity_is_one_over_the_mean_service_time_per_worker():
    """A CPU worker: prompts at 130 tokens/s, decode 28 tokens/s at batch 4 (TPOT 142 ms). A request of 260
    prompt and 28 answer tokens takes 2 s + 1 s; two such workers complete 2 / 3 s = 0.667 requests/s."""
    cpu = {"prefill_tokens_per_s": 130.0, "decode_tokens_per_s": 28.0, "sequence_decode_tokens_per_s": 7.0}
    capacity = capacity_from_status(status_of(cpu, cpu))
    assert capacity.num_workers == 2 and len(capacity.measured) == 2
    assert capacity.measured[0].decode_batch == pytest.approx(4.0)
    assert capacity.requests_per_s([260], [28]) == pytest.approx(2 / 3)
    assert capacity.requests_per_s([260, 520], [28, 28]) == pytest.approx(2 / 4)  # mean service 4 s
    assert "prefill 130 tokens/s, decode 28.0 tokens/s at batch 4.0" in capacity.describe()


def test_a_worker_without_rates_counts_at_the_mean_of_the_measured_ones():
    cpu = {"prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 10.0}
    capacity = capacity_from_status(status_of(cpu, {"prefill_tokens_per_s": 0.0}))
    assert capacity.num_workers == 2 and [w.name for w in capacity.measured] == ["w0"]
    assert capacity.requests_per_s([100], [10]) == pytest.approx(2 / 2.0)
    assert capacity_from_status(status_of({})).measured == []


def test_rate_scale_makes_the_trace_arrive_at_the_wanted_multiple_of_capacity():
    requests = [TraceRequest(arrival_s=10.0 * i, input_tokens=100, output_tokens=10) for i in range(5)]  # 0.1/s
    assert rate_scale_for(2.0, 0.5, requests) == pytest.approx(10.0)  # 2 × 0.5 = 1 request/s = 10 × 0.1/s
    capacity = MeasuredCapacity(1, [WorkerRates("w", 100.0, 10.0, 10.0)])
    assert capacity.requests_per_s([100], [10]) == pytest.approx(0.5)
