"""Sizing a replay to the gateway's measured capacity (loadtest/sizing.py)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from loadtest.sizing import MeasuredCapacity, SizingError, WorkerRates, capacity_from_status, measure_capacity, \
    rate_scale_for
from loadtest.traces import TraceRequest
from tests.support.loopback import serve_routes


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


def test_a_mixed_fleet_is_sized_by_the_replayed_models_pool_at_its_engines_prefill_speed():
    """README trial 17: in a fleet of our pool and a llama.cpp pool, the replay counted both pools' workers (the
    llama.cpp one serves another model) and took the upstream's prompt tokens per busy second (3.9) for its prefill
    speed (107 by the engine's own prompt time): '2x capacity' was far below it, and ten times apart a minute later."""
    ours = {"prefill_tokens_per_s": 250.0, "decode_tokens_per_s": 30.0, "sequence_decode_tokens_per_s": 10.0}
    engine = {"prefill_tokens_per_s": 3.9, "sequence_prefill_tokens_per_s": 107.0, "decode_tokens_per_s": 31.6}
    status = {"fleet": {"pools": {"ours": {"model": "small"}, "llamacpp": {"model": "small-llamacpp"}}},
              "workers": [{"name": "ours-0", "pool": "ours", "capacity": ours},
                          {"name": "llamacpp-upstream-0", "pool": "llamacpp", "capacity": engine}]}
    for_ours = capacity_from_status(status, "small")
    assert for_ours.num_workers == 1 and [w.name for w in for_ours.measured] == ["ours-0"]
    for_engine = capacity_from_status(status, "small-llamacpp")
    assert for_engine.measured[0].prefill_tokens_per_s == 107.0
    assert capacity_from_status(status).num_workers == 2  # no model named: every worker, as before


def test_rate_scale_makes_the_trace_arrive_at_the_wanted_multiple_of_capacity():
    requests = [TraceRequest(arrival_s=10.0 * i, input_tokens=100, output_tokens=10) for i in range(5)]  # 0.1/s
    assert rate_scale_for(2.0, 0.5, requests) == pytest.approx(10.0)  # 2 × 0.5 = 1 request/s = 10 × 0.1/s
    capacity = MeasuredCapacity(1, [WorkerRates("w", 100.0, 10.0, 10.0)])
    assert capacity.requests_per_s([100], [10]) == pytest.approx(0.5)


async def test_calibration_honours_no_ignore_eos_and_a_failed_calibration_names_the_first_error():
    """A gateway in front of an engine that refuses ``ignore_eos`` (400 naming it) and reports no rates: the
    calibration sends ``ignore_eos`` only when asked, and the error names the status and message of the first
    failed request instead of only "no worker reported rates"."""
    bodies: list[dict] = []

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"workers": [{"name": "upstream-0", "capacity": {"prefill_tokens_per_s": 0.0}}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        if body.get("ignore_eos"):
            return web.json_response({"error": {"message": "ignore_eos is not available from model 'm'",
                                                "type": "invalid_request_error", "param": "ignore_eos",
                                                "code": "invalid_value"}}, status=400)
        return web.json_response({"error": {"message": "upstream u failed", "type": "server_error", "param": None,
                                            "code": "worker_failed"}}, status=502)

    base_url, runner = await serve_routes(("GET", "/status", status), ("POST", "/v1/chat/completions", chat))
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(SizingError) as info:
                await measure_capacity(session, base_url, "m", ["a", "b"], {}, settle_s=0.0)
            assert all(body["ignore_eos"] is True for body in bodies) and len(bodies) == 2
            message = str(info.value)
            assert "2 of 2 calibration requests failed; the first: HTTP 400: ignore_eos is not available from " \
                   "model 'm' (param: ignore_eos); pass --no-ignore-eos" in message, message
            bodies.clear()
            with pytest.raises(SizingError) as info:
                await measure_capacity(session, base_url, "m", ["a"], {}, settle_s=0.0, ignore_eos=False)
            assert bodies and all("ignore_eos" not in body for body in bodies)
            assert "the first: HTTP 502: upstream u failed)" in str(info.value), info.value
    finally:
        await runner.cleanup()
