"""Trace loading, rate scaling, bounds and the deterministic tier mix (loadtest/traces.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtest.traces import (
    TraceError,
    TraceRequest,
    assign_tiers,
    busy_rate_per_s,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
    parse_mix,
    shape_trace,
    tier_counts,
    trace_stats,
)


def test_azure_csv_parses_seven_digit_fractions_and_rebases(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:04.0319600,3180,8\n"
                    "2023-11-16 18:17:03.9799600,4808,10\n"
                    "2023-11-16 18:17:05.9799600,12,1\n")
    trace = load_azure_csv(path)
    assert [r.input_tokens for r in trace] == [4808, 3180, 12]
    assert [r.output_tokens for r in trace] == [10, 8, 1]
    assert trace[0].arrival_s == 0.0
    assert trace[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert trace[2].arrival_s == pytest.approx(2.0, abs=1e-6)


def test_azure_csv_missing_column_is_an_error_naming_it(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:04.03,1\n")
    with pytest.raises(TraceError, match="GeneratedTokens"):
        load_azure_csv(path)


def test_mooncake_jsonl_reads_ms_and_hash_ids(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}\n'
                    '{"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [46]}\n')
    trace = load_mooncake_jsonl(path)
    assert trace[0] == TraceRequest(0.0, 6955, 52, (46, 47))
    assert trace[1].arrival_s == pytest.approx(3.053)
    assert trace[1].hash_ids == (46,)


@pytest.mark.parametrize("name,count,mean_out", [("azure-code", 8819, 27.88), ("azure-conv", 19366, 211.13),
                                                ("mooncake-conv", 12031, 343.0)])
def test_shared_traces_load_whole(name, count, mean_out):
    trace = load_trace(name)
    stats = trace_stats(trace)
    assert stats.num_requests == count
    assert stats.mean_output_tokens == pytest.approx(mean_out, abs=1.0)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(trace, trace[1:]))


def test_rate_scale_compresses_inter_arrivals_and_bounds_hold():
    trace = [TraceRequest(float(t), 10, 5) for t in (100, 102, 104, 110, 130)]
    shaped = shape_trace(trace, rate_scale=2.0)
    assert [r.arrival_s for r in shaped] == [0.0, 1.0, 2.0, 5.0, 15.0]
    assert [r.arrival_s for r in shape_trace(trace, rate_scale=2.0, max_requests=2)] == [0.0, 1.0]
    assert [r.arrival_s for r in shape_trace(trace, rate_scale=2.0, duration_s=5.0)] == [0.0, 1.0, 2.0]
    assert [r.arrival_s for r in shape_trace(trace, rate_scale=1.0, start_s=104)] == [0.0, 6.0, 26.0]
    with pytest.raises(TraceError):
        shape_trace(trace, rate_scale=0)


def test_rate_scale_multiplies_the_measured_rate():
    trace = shape_trace(load_trace("azure-conv"), max_requests=500)
    assert trace_stats(shape_trace(trace, rate_scale=3.0)).rate_per_s == pytest.approx(
        3.0 * trace_stats(trace).rate_per_s)


def test_busy_rate_leaves_the_idle_windows_out():
    # arrivals in windows 0 and 3 of 10 s (windows 1 and 2 idle): 6 requests over 2 busy windows
    trace = [TraceRequest(float(t), 10, 5) for t in (0, 2, 4, 31, 33, 39)]
    assert busy_rate_per_s(trace, window_s=10.0) == pytest.approx(6 / 20)
    assert trace_stats(trace).rate_per_s == pytest.approx(5 / 39)
    # scaling the trace scales the busy rate too (windows are on the scaled clock)
    assert busy_rate_per_s(shape_trace(trace, rate_scale=2.0), window_s=5.0) == pytest.approx(6 / 10)
    assert busy_rate_per_s([], window_s=10.0) == 0.0
    with pytest.raises(TraceError):
        busy_rate_per_s(trace, window_s=0)


def test_tier_mix_is_exact_and_deterministic():
    trace = [TraceRequest(float(i), 1, 1) for i in range(101)]
    mix = parse_mix("vip=0.2,standard=0.6,free=0.2")
    assert tier_counts(101, mix) == {"vip": 20, "standard": 61, "free": 20}
    first = [r.tier for r in assign_tiers(trace, mix, seed=7)]
    assert first == [r.tier for r in assign_tiers(trace, mix, seed=7)]
    assert first != [r.tier for r in assign_tiers(trace, mix, seed=8)]
    assert Counter(first) == {"vip": 20, "standard": 61, "free": 20}


def test_parse_mix_normalises_and_rejects_garbage():
    assert parse_mix("a=1,b=3") == {"a": 0.25, "b": 0.75}
    for bad in ("a", "a=-1", "a=0", "a=x"):
        with pytest.raises(TraceError):
            parse_mix(bad)
