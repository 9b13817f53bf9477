"""CircuitBreaker: closed → open after N consecutive failures → half-open with one probe → closed or open."""

from __future__ import annotations

import pytest

from gateway.workers.breaker import BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make(threshold: int = 3, cooldown_s: float = 10.0) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(failure_threshold=threshold, cooldown_s=cooldown_s, clock=clock), clock


def test_opens_after_n_consecutive_failures():
    breaker, _ = make(threshold=3)
    for _ in range(2):
        assert breaker.allow_request()
        breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.available() and not breaker.allow_request()
    assert breaker.num_opens == 1


def test_a_success_resets_the_consecutive_count():
    breaker, _ = make(threshold=3)
    breaker.on_failure()
    breaker.on_failure()
    breaker.on_success()
    breaker.on_failure()
    breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED


def test_half_open_after_cooldown_lets_exactly_one_probe_through():
    breaker, clock = make(threshold=1, cooldown_s=10.0)
    breaker.on_failure()
    clock.now_s = 9.9
    assert breaker.state is BreakerState.OPEN and not breaker.allow_request()
    clock.now_s = 10.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.available()
    assert breaker.allow_request()
    assert not breaker.available()
    assert not breaker.allow_request()  # the second request waits for the probe's verdict


def test_probe_now_half_opens_an_open_breaker_before_its_cooldown_and_touches_no_other_state():
    breaker, clock = make(threshold=1, cooldown_s=10.0)
    breaker.probe_now()
    assert breaker.state is BreakerState.CLOSED
    breaker.on_failure()
    clock.now_s = 1.0
    breaker.probe_now()  # a health check says the target is back
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allow_request() and not breaker.allow_request()
    breaker.probe_now()  # half-open already: the probe in flight keeps its slot
    assert not breaker.available()
    breaker.on_failure()  # the probe failed: open for a new cooldown
    clock.now_s = 10.9
    assert breaker.state is BreakerState.OPEN


def test_probe_success_closes():
    breaker, clock = make(threshold=1)
    breaker.on_failure()
    clock.now_s = 10.0
    assert breaker.allow_request()
    breaker.on_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow_request() and breaker.allow_request()


def test_probe_failure_reopens_for_a_new_cooldown():
    breaker, clock = make(threshold=1)
    breaker.on_failure()
    clock.now_s = 10.0
    assert breaker.allow_request()
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN and breaker.num_opens == 2
    clock.now_s = 19.9
    assert not breaker.allow_request()
    clock.now_s = 20.0
    assert breaker.allow_request()


def test_abandoned_probe_frees_the_probe_slot():
    breaker, clock = make(threshold=1)
    breaker.on_failure()
    clock.now_s = 10.0
    assert breaker.allow_request()
    breaker.on_abandoned()
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow_request()


def test_invalid_settings_are_errors():
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown_s=-1.0)


def test_snapshot():
    breaker, _ = make(threshold=1)
    breaker.on_failure()
    assert breaker.snapshot() == {"state": "open", "consecutive_failures": 1, "num_opens": 1}
