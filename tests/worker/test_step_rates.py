"""The worker's reported rates against a known workload: a fake model runner whose every step takes a fixed time
on a controlled clock, under the real engine, scheduler and KV manager. The rates the engine reports must equal
the speeds the requests themselves saw (prompt tokens ÷ prefill time, 1 ÷ TPOT), whatever else shared the steps.
"""

from __future__ import annotations

import pytest

from shared.config import KVConfig
from shared.protocol import Generate, SamplingParams
from worker.engine import Engine
from worker.kv_cache.manager import KVCacheManager
from worker.scheduler import Scheduler, SchedulerOutput
from worker.step_rates import BusyRate, StepRates

STEP_S = 0.1  # every step of the fake runner, seconds


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class FixedStepRunner:
    """Samples token 7 for every sequence that samples; each step advances the clock by ``STEP_S``."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.step_logprobs = {}

    def run(self, out: SchedulerOutput, should_stop=None) -> dict[str, int]:
        self.clock.now_s += STEP_S
        return {item.seq.request_id: 7 for item in out.scheduled if item.sample}


def make_engine(max_num_batched_tokens: int) -> tuple[Engine, FakeClock]:
    clock = FakeClock()
    manager = KVCacheManager(1024, 16, config=KVConfig())
    scheduler = Scheduler(manager, 8, max_num_batched_tokens, 8192)
    return Engine(scheduler, FixedStepRunner(clock), [2], clock=clock), clock


def generate(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Generate:
    """A prompt of its own tokens (no prefix shared with another request's), output ``max_tokens`` long."""
    first = 1000 * (1 + sum(map(ord, request_id)) % 50)
    return Generate(request_id, [first + i % 900 for i in range(num_prompt_tokens)], SamplingParams(temperature=0.0),
                    max_tokens, ignore_eos=True)


def run_until_done(engine: Engine, clock: FakeClock) -> dict[str, list[float]]:
    """Step until idle; return each request's token times on the clock, seconds."""
    token_times_s: dict[str, list[float]] = {}
    while engine.has_work():
        for event in engine.step().events:
            assert event.error is None
            token_times_s.setdefault(event.request_id, []).extend([clock.now_s] * len(event.new_token_ids))
    return token_times_s


def tpot_s(times_s: list[float]) -> float:
    return (times_s[-1] - times_s[0]) / (len(times_s) - 1)


def test_rates_equal_the_prefill_speed_and_tpot_of_one_request():
    engine, clock = make_engine(max_num_batched_tokens=250)
    start_s = clock.now_s
    engine.add("a", generate("a", 1000, 41))
    times_s = run_until_done(engine, clock)["a"]
    prefill_tokens_per_s = 1000 / (times_s[0] - start_s)  # 4 steps of 250 tokens
    assert prefill_tokens_per_s == pytest.approx(2500.0)
    assert engine.prefill_tokens_per_s() == pytest.approx(prefill_tokens_per_s, rel=0.02)
    assert engine.sequence_prefill_tokens_per_s() == pytest.approx(prefill_tokens_per_s, rel=0.02)
    assert engine.sequence_decode_tokens_per_s() == pytest.approx(1 / tpot_s(times_s), rel=0.02)
    assert engine.decode_tokens_per_s() == pytest.approx(1 / STEP_S, rel=0.02)  # batch 1: 10 tokens/s, not diluted
    assert engine.busy_tokens_per_s() == pytest.approx(1040 / (44 * STEP_S), rel=0.02)  # the work of every step


def test_decode_rate_sums_the_batch_and_the_sequence_rate_is_one_over_tpot():
    engine, clock = make_engine(max_num_batched_tokens=512)
    for request_id in "abcd":
        engine.add(request_id, generate(request_id, 100, 60))
    token_times_s = run_until_done(engine, clock)
    tpot = tpot_s(token_times_s["a"])
    assert tpot == pytest.approx(STEP_S)
    assert engine.sequence_decode_tokens_per_s() == pytest.approx(1 / tpot, rel=0.02)
    assert engine.decode_tokens_per_s() == pytest.approx(4 / tpot, rel=0.02)
    assert engine.prefill_tokens_per_s() == pytest.approx(400 / STEP_S, rel=0.02)  # one step prefilled all four


def test_a_long_prompt_prefilled_beside_decoding_reports_its_own_speed():
    """Mixed steps: one request decodes while a 1,000-token prompt is prefilled 250 tokens a step beside it. The
    reported prefill rate is the prompts' speed (not prompt tokens ÷ every busy second, decode-only steps too),
    the decode rate the first request's 1 / TPOT."""
    engine, clock = make_engine(max_num_batched_tokens=251)
    engine.add("short", generate("short", 250, 200))
    engine.step()  # prefills "short": 250 tokens in one step, the long prompt's speed too
    for _ in range(60):
        engine.step()  # decode only
    start_s = clock.now_s
    engine.add("long", generate("long", 1000, 2))
    token_times_s = run_until_done(engine, clock)
    long_prefill_tokens_per_s = 1000 / (token_times_s["long"][0] - start_s)
    assert long_prefill_tokens_per_s == pytest.approx(1000 / (4 * STEP_S))
    assert engine.prefill_tokens_per_s() == pytest.approx(long_prefill_tokens_per_s, rel=0.02)
    assert engine.sequence_decode_tokens_per_s() == pytest.approx(1 / tpot_s(token_times_s["short"]), rel=0.02)


def test_idle_time_leaves_the_rates_as_last_measured():
    engine, clock = make_engine(max_num_batched_tokens=512)
    engine.add("a", generate("a", 100, 20))
    run_until_done(engine, clock)
    before = (engine.prefill_tokens_per_s(), engine.decode_tokens_per_s(), engine.busy_tokens_per_s())
    clock.now_s += 600.0
    engine.step()  # nothing to do
    assert (engine.prefill_tokens_per_s(), engine.decode_tokens_per_s(), engine.busy_tokens_per_s()) == before
    assert before[1] == pytest.approx(1 / STEP_S)


def test_busy_rate_window_keeps_the_last_busy_seconds_and_the_newest_sample():
    rate = BusyRate(window_busy_s=1.0)
    rate.add(1000, 4.0)  # one step longer than the window: its own rate
    assert rate.tokens_per_s() == 250.0
    for _ in range(20):
        rate.add(10, 0.1)  # 2 s of decode at 100 tokens/s pushes the long step out
    assert rate.tokens_per_s() == pytest.approx(100.0)


def test_step_rates_count_a_mixed_step_in_both_phases_and_once_in_busy():
    rates = StepRates()
    rates.observe(num_prefill_tokens=200, num_decode_tokens=8, step_s=0.5)
    rates.observe(num_prefill_tokens=0, num_decode_tokens=8, step_s=0.1)
    assert rates.prefill_tokens_per_s() == pytest.approx(400.0)
    assert rates.decode_tokens_per_s() == pytest.approx(16 / 0.6)
    assert rates.sequence_decode_tokens_per_s() == pytest.approx(2 / 0.6)
    assert rates.busy_tokens_per_s() == pytest.approx(216 / 0.6)
