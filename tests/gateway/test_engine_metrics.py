"""The engine metrics parsers on recorded ``/metrics`` texts shaped like each engine's (tests/fixtures/
engine_metrics/), the rates from their token counters, and the upstream SSE chunk decoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.upstream.engine_metrics import (
    EngineSnapshot,
    MetricsParseError,
    llamacpp_slot_context_tokens,
    parse_engine_metrics,
    parse_llamacpp_slots,
)
from gateway.upstream.probe import EngineProbe
from gateway.upstream.rates import StreamDecodeRate, UpstreamRates
from gateway.upstream.sse import SSEFormatError, UpstreamDelta, decode_event

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine_metrics"


@pytest.mark.parametrize(("fixture", "engine", "expected"), [
    ("vllm.txt", "vllm", EngineSnapshot(7, 3, 0.4125, 18211.0, 52044.0, sequence_prefill_tokens_per_s=17940 / 2.99)),
    ("vllm_v0.txt", "vllm", EngineSnapshot(2, 0, 0.07, 1234.0, 5678.0)),  # gpu_cache_usage_perc before v0.10
    ("sglang.txt", "sglang", EngineSnapshot(162, 2826, 0.28, 8128902.0, 7557572.0, kv_capacity_tokens=161721,
                                            reported_decode_tokens_per_s=2994.28)),
    ("llamacpp.txt", "llama.cpp", EngineSnapshot(4, 1, 0.25, 6886.0, 3469.0, reported_prefill_tokens_per_s=237.2,
                                                 reported_decode_tokens_per_s=97.9,
                                                 sequence_prefill_tokens_per_s=6886 / 29.03)),
    ("tgi.txt", "tgi", EngineSnapshot(5, 9, None, 30210.0, 14820.0)),
])
def test_parsers_read_each_engines_metrics(fixture, engine, expected):
    assert parse_engine_metrics(engine, (FIXTURES / fixture).read_text()) == expected


def test_a_metrics_text_of_another_engine_is_an_error_naming_the_missing_gauge():
    with pytest.raises(MetricsParseError, match="vllm:num_requests_running"):
        parse_engine_metrics("vllm", (FIXTURES / "sglang.txt").read_text())
    with pytest.raises(ValueError, match="engines with one"):
        parse_engine_metrics("generic", "")


def test_label_sets_are_summed():
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
            'vllm:num_requests_waiting{engine="1"} 4\n')
    assert parse_engine_metrics("vllm", text) == EngineSnapshot(5, 4)


def test_llamacpp_slots_count_busy_and_total():
    assert parse_llamacpp_slots(json.loads((FIXTURES / "llamacpp_slots.json").read_text())) == (2, 4)


def test_llamacpp_slot_context_is_the_smallest_n_ctx_of_its_slots():
    slots = json.loads((FIXTURES / "llamacpp_slots.json").read_text())
    assert llamacpp_slot_context_tokens(slots) == 2048
    assert llamacpp_slot_context_tokens([{**slots[0], "n_ctx": 1024}, *slots[1:]]) == 1024
    assert llamacpp_slot_context_tokens([{"id": 0, "is_processing": False}]) is None  # a server that does not say


def test_rates_come_from_counter_increases_while_busy():
    rates = UpstreamRates()
    rates.observe(10.0, 1000, 500, busy=True)
    assert rates.busy_tokens_per_s == 0.0  # one reading: no interval yet
    rates.observe(11.0, 1400, 600, busy=True)
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (400.0, 100.0)
    rates.observe(20.0, 1400, 600, busy=False)  # idle: the rates stay what the engine does when it works
    assert rates.busy_tokens_per_s == 500.0
    rates.observe(21.0, 10, 5, busy=True)  # counters went back: the engine restarted
    assert rates.busy_tokens_per_s == 500.0


def test_counters_that_move_only_when_a_request_ends_are_spread_over_the_busy_span():
    """llama.cpp adds a request's output tokens to llamacpp:tokens_predicted_total when the request ends: readings
    while it answers are no samples of zero, and the jump is spread over the whole busy span."""
    rates = UpstreamRates()
    rates.observe(0.0, 0, 0, busy=False)
    for t in (0.25, 0.5, 1.0, 2.0, 3.75):  # one request answers for 4 s; its prompt was counted at 0.5 s
        rates.observe(t, 100 if t >= 0.5 else 0, 0, busy=True)
    assert rates.prefill_tokens_per_s == 200.0  # 100 prompt tokens in the span 0 → 0.5 s
    assert rates.decode_tokens_per_s == 0.0  # nothing counted of the answer yet, and no zero sample either
    rates.observe(4.0, 100, 200, busy=True)  # the answer ends: 200 tokens over 0.5 → 4.0 s
    assert rates.decode_tokens_per_s == 200 / 4.0  # the window's spans: 0 → 0.5 s and 0.5 → 4.0 s
    # staggered ends of answers that ran side by side: the window's tokens ÷ its busy seconds
    for t, generated in ((6.0, 200 + 300), (8.0, 200 + 300 + 100)):
        rates.observe(t, 100, generated, busy=True)
    assert rates.decode_tokens_per_s == (200 + 300 + 100) / 8.0
    # spans that ended more than RATE_WINDOW_S ago leave the average (the last one always stays)
    rates.observe(30.0, 100, 600, busy=False)  # idle: no span
    rates.observe(31.0, 200, 700, busy=True)
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (100.0, 100.0)


def test_one_requests_decode_speed_comes_from_the_streams_the_gateway_read():
    rate = StreamDecodeRate()
    rate.observe(5.0, 1, 4.0, 4.0)  # one token: no interval
    rate.observe(5.0, 10, 4.0, 4.0)  # all at once: no interval either
    assert rate.tokens_per_s == 0.0
    rate.observe(10.0, 41, 6.0, 10.0)  # 40 tokens after the first in 4 s
    assert rate.tokens_per_s == 10.0
    rate.observe(12.0, 21, 10.0, 12.0)  # side by side, 20 in 2 s: a ratio of sums, 60 tokens in 6 s
    assert rate.tokens_per_s == 10.0
    rate.observe(13.0, 31, 12.0, 13.0)  # 30 in 1 s
    assert rate.tokens_per_s == 90 / 7
    rate.observe(40.0, 11, 39.0, 40.0)  # streams that ended more than RATE_WINDOW_S ago leave the average
    assert rate.tokens_per_s == 10.0


@pytest.mark.parametrize(("data", "expected"), [
    ('{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}', UpstreamDelta()),
    ('{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}', UpstreamDelta("Hi")),
    ('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":null}', UpstreamDelta("", "length")),
    ('{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13,'
     '"prompt_tokens_details":{"cached_tokens":8}}}', UpstreamDelta("", None, 9, 4, 8)),
    ('{"choices":[{"index":0,"text":" there","finish_reason":"stop"}]}', UpstreamDelta(" there", "stop")),
    ('{"error":{"message":"CUDA out of memory","type":"server_error"}}', UpstreamDelta(error="CUDA out of memory")),
])
def test_sse_events_of_the_engines_decode_to_text_finish_and_usage(data, expected):
    assert decode_event(data) == expected


def test_a_data_line_that_is_not_json_is_an_error():
    with pytest.raises(SSEFormatError):
        decode_event("<html>502 Bad Gateway</html>")


def test_one_prompts_prefill_speed_is_the_engines_own_where_it_reports_one():
    """README trial 16: one llama.cpp prompt's prefill speed was taken as prompt tokens per busy second, 8.5
    tokens/s where llama-server's own counters said 252 (its busy time is mostly decode): predicted waits came out
    30 s for a sub-second wait, raised the pressure level to critical and turned requests away with Retry-After 27.
    The Capacity's per-sequence prefill rate is the engine's prompt tokens ÷ its prompt seconds."""
    probe = EngineProbe("http://127.0.0.1:1", "engine", engine="llama.cpp", model="m", model_key="upstream_model",
                        headers={}, max_concurrency=2, kv_capacity_tokens=0, max_model_len_tokens=2048,
                        metrics_interval_s=0.25, on_change=lambda: None)
    snapshot = parse_engine_metrics("llama.cpp", (FIXTURES / "llamacpp.txt").read_text())
    capacity = probe.capacity(snapshot, total_kv_blocks=512)
    assert capacity.sequence_prefill_tokens_per_s == pytest.approx(237.2, rel=1e-3)
    without = EngineSnapshot(2, 0, 0.1, 100.0, 50.0, reported_prefill_tokens_per_s=40.0)  # no prompt seconds
    assert probe.capacity(without, total_kv_blocks=512).sequence_prefill_tokens_per_s == 40.0
