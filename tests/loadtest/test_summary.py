"""Replay summary math on synthetic results (loadtest/summary.py)."""

from __future__ import annotations

import pytest

from loadtest.summary import RequestResult, offered_window_s, percentiles, summarize


def _ok(index: int, tier: str, ttft_s: float, arrival_s: float = 0.0) -> RequestResult:
    return RequestResult(index=index, tier=tier, arrival_s=arrival_s, input_tokens=100, max_tokens=11, outcome="ok",
                         status=200, ttft_s=ttft_s, tpot_s=0.01, e2e_s=ttft_s + 0.1, completion_tokens=11)


def test_percentiles_interpolate_linearly():
    p = percentiles([float(v) for v in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert p["max"] == 100.0
    assert percentiles([])["p50"] is None


def test_offered_window_is_requests_over_rate():
    assert offered_window_s([0.0, 1.0, 2.0, 3.0, 4.0]) == pytest.approx(5.0)
    assert offered_window_s([3.0]) == 0.0


def test_slo_attainment_counts_every_request_of_the_tier_and_goodput_uses_the_window():
    results = [_ok(i, "vip", ttft_s=0.1 * (i + 1), arrival_s=float(i)) for i in range(8)]  # TTFT 0.1 … 0.8
    results.append(RequestResult(index=8, tier="vip", arrival_s=8.0, input_tokens=1, max_tokens=1,
                                 outcome="http_error", status=503, error_code="queue_timeout", retry_after_s=3.0))
    results.append(RequestResult(index=9, tier="vip", arrival_s=9.0, input_tokens=1, max_tokens=1,
                                 outcome="http_error", status=429, error_code="rate_limit_exceeded"))
    summary = summarize(results, {"vip": 0.45})
    vip = summary["tiers"]["vip"]
    assert summary["window_s"] == pytest.approx(10.0)
    assert vip["count"] == 10 and vip["ok"] == 8 and vip["rejected"] == 2
    assert vip["slo_met"] == 4  # TTFT 0.1, 0.2, 0.3, 0.4 ≤ 0.45
    assert vip["slo_attainment"] == pytest.approx(0.4)
    assert vip["goodput_per_s"] == pytest.approx(0.4)
    assert vip["ttft_s"]["p50"] == pytest.approx(0.45)
    assert vip["rejections"]["queue_timeout"] == {"count": 1, "status": 503, "with_retry_after": 1,
                                                  "retry_after_s": {"min": 3.0, "p50": 3.0, "max": 3.0}}
    assert vip["rejections"]["rate_limit_exceeded"]["with_retry_after"] == 0
    assert vip["all_rejections_have_retry_after"] is False
    assert vip["outcomes"] == {"ok": 8, "http_503": 1, "http_429": 1}


def test_overall_uses_each_tiers_own_slo():
    results = [_ok(0, "vip", 0.5, 0.0), _ok(1, "vip", 1.5, 1.0), _ok(2, "free", 1.5, 2.0), _ok(3, "free", 6.0, 3.0)]
    summary = summarize(results, {"vip": 1.0, "free": 5.0})
    assert summary["tiers"]["vip"]["slo_met"] == 1
    assert summary["tiers"]["free"]["slo_met"] == 1
    assert summary["all"]["slo_met"] == 2
    assert summary["all"]["slo_attainment"] == pytest.approx(0.5)
    assert summary["all"]["goodput_per_s"] == pytest.approx(2 / 4.0)
    assert summary["all"]["all_rejections_have_retry_after"] is True


def test_failed_streams_and_timeouts_are_misses_not_latency_samples():
    results = [_ok(0, "standard", 0.2, 0.0),
               RequestResult(index=1, tier="standard", arrival_s=1.0, input_tokens=1, max_tokens=1,
                             outcome="error_in_band", status=200, ttft_s=0.1, error_code="worker_failed"),
               RequestResult(index=2, tier="standard", arrival_s=2.0, input_tokens=1, max_tokens=1)]
    s = summarize(results, {"standard": 5.0})["tiers"]["standard"]
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["ttft_s"]["max"] == pytest.approx(0.2)
    assert s["outcomes"] == {"ok": 1, "error_in_band": 1, "client_timeout": 1}
    assert s["rejected"] == 0


def test_the_table_gives_the_reasons_requests_were_not_ok():
    from loadtest.summary import format_table

    results = [_ok(0, "vip", 0.1, 0.0), _ok(1, "free", 0.2, 1.0)]
    results += [RequestResult(index=2 + i, tier="free", arrival_s=2.0 + i, input_tokens=1, max_tokens=1,
                              outcome="http_error", status=503, error_code="queue_timeout", retry_after_s=3.0 + i)
                for i in range(3)]
    results.append(RequestResult(index=5, tier="free", arrival_s=6.0, input_tokens=1, max_tokens=1,
                                 outcome="http_error", status=503, error_code="predicted_queue_timeout",
                                 retry_after_s=9.0))
    results.append(RequestResult(index=6, tier="free", arrival_s=7.0, input_tokens=1, max_tokens=1,
                                 outcome="client_timeout"))
    table = format_table(summarize(results, {"vip": 1.0, "free": 1.0}))
    assert "not ok, by reason" in table
    free_line = next(line for line in table.splitlines() if line.startswith("  free"))
    assert free_line.split(None, 1)[1] == ("queue_timeout 3 (503, Retry-After p50 4 s), "
                                           "predicted_queue_timeout 1 (503, Retry-After p50 9 s), client_timeout 1")
    assert not any(line.startswith("  vip") for line in table.splitlines())  # all ok: no reason line
