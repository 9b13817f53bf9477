"""Autoscaler decisions, pinned exactly with a fake clock: min/max, sustain windows, scale from and to zero, victim
choice, cold-start estimates, remote workers, worker-seconds."""

from __future__ import annotations

import pytest

from gateway.fleet.autoscaler import (
    Autoscaler,
    PoolObservation,
    ScaleAction,
    ScaleReason,
    WorkerSecondsMeter,
    WorkerState,
    WorkerView,
)
from gateway.admission.pressure import PressureLevel
from shared.config import AutoscaleConfig, PoolConfig

READY, STARTING, DRAINING = WorkerState.READY, WorkerState.STARTING, WorkerState.DRAINING


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def pool(**overrides) -> PoolConfig:
    values = dict(name="p", backend="sim", min_workers=0, max_workers=4, scale_up_after_s=5.0,
                  scale_down_after_s=30.0, target_queue_wait_s=2.0)
    values.update(overrides)
    return PoolConfig(**values)


def make(clock: FakeClock, *pools: PoolConfig, **autoscale) -> Autoscaler:
    config = AutoscaleConfig(**{"initial_cold_start_s": 20.0, **autoscale})
    return Autoscaler(pools or (pool(),), config, clock)


def workers(*states: WorkerState, in_flight: tuple[int, ...] = (), local: bool = True) -> list[WorkerView]:
    return [
        WorkerView(f"w{i}", state, started_at_s=float(i), num_in_flight=in_flight[i] if in_flight else 0, local=local)
        for i, state in enumerate(states)
    ]


def obs(ws, wait_s=None, queued=0, pressure=PressureLevel.NORMAL, utilisation=0.0, name="p") -> PoolObservation:
    return PoolObservation(name, ws, wait_s, queued, pressure, utilisation)


def test_starts_missing_workers_up_to_min_at_once():
    clock = FakeClock()
    scaler = make(clock, pool(min_workers=3))
    [decision] = scaler.tick([obs(workers(READY))])
    assert (decision.action, decision.reason, decision.num_workers) == (
        ScaleAction.UP, ScaleReason.BELOW_MIN_WORKERS, 2)
    # draining workers do not count: they are on their way out
    [decision] = scaler.tick([obs(workers(READY, READY, DRAINING))])
    assert decision.num_workers == 1
    assert scaler.tick([obs(workers(READY, STARTING, STARTING))]) == []


def test_queued_request_with_no_worker_starts_one_at_once_and_only_one():
    clock = FakeClock()
    scaler = make(clock)
    assert scaler.tick([obs([], queued=0)]) == []  # nothing to serve: stay at zero
    [decision] = scaler.tick([obs([], queued=3)])
    assert (decision.action, decision.reason, decision.num_workers) == (
        ScaleAction.UP, ScaleReason.QUEUED_WITHOUT_WORKER, 1)
    clock.now_s = 100.0  # while it starts, however long the queue waits, no second cold start for the same reason
    assert scaler.tick([obs(workers(STARTING), queued=3)]) == []


def test_max_workers_zero_never_starts_a_local_worker():
    scaler = make(FakeClock(), pool(max_workers=0))
    assert scaler.tick([obs([], queued=5, pressure=PressureLevel.CRITICAL)]) == []


def test_queue_wait_scale_up_waits_for_the_sustain_window_then_sizes_proportionally():
    clock = FakeClock()
    scaler = make(clock)
    two_ready = workers(READY, READY)
    assert scaler.tick([obs(two_ready, wait_s=5.0)]) == []  # t=0: condition starts
    clock.now_s = 4.9
    assert scaler.tick([obs(two_ready, wait_s=5.0)]) == []
    clock.now_s = 5.0
    [decision] = scaler.tick([obs(two_ready, wait_s=5.0)])
    # ceil(2 ready × 5 s ÷ 2 s) = 5 wanted, capped at max_workers 4: start 2
    assert (decision.reason, decision.num_workers, decision.at_s) == (ScaleReason.QUEUE_WAIT_ABOVE_TARGET, 2, 5.0)
    # the window restarts: the workers now starting count, and nothing more is due before t=10
    clock.now_s = 9.9
    assert scaler.tick([obs(workers(READY, READY, STARTING, STARTING), wait_s=5.0)]) == []


def test_workers_already_starting_count_toward_the_proportional_target():
    clock = FakeClock()
    scaler = make(clock, pool(max_workers=8))
    ws = workers(READY, READY, STARTING)
    scaler.tick([obs(ws, wait_s=3.0)])
    clock.now_s = 5.0
    # ceil(2 × 3 ÷ 2) = 3 = 2 ready + 1 starting: enough once it is up
    assert scaler.tick([obs(ws, wait_s=3.0)]) == []
    clock.now_s = 10.0
    [decision] = scaler.tick([obs(ws, wait_s=6.0)])  # ceil(2 × 6 ÷ 2) = 6 → 3 more
    assert decision.num_workers == 3


def test_an_interrupted_condition_restarts_the_sustain_window():
    clock = FakeClock()
    scaler = make(clock)
    ws = workers(READY)
    scaler.tick([obs(ws, wait_s=3.0)])
    clock.now_s = 4.0
    scaler.tick([obs(ws, wait_s=1.0)])  # dips below target
    clock.now_s = 6.0
    assert scaler.tick([obs(ws, wait_s=3.0)]) == []
    clock.now_s = 11.0
    [decision] = scaler.tick([obs(ws, wait_s=3.0)])
    assert decision.num_workers == 1  # ceil(1 × 3 ÷ 2) − 1 = 1


def test_sustained_pressure_on_a_busy_pool_adds_one_worker_at_a_time():
    clock = FakeClock()
    scaler = make(clock)
    ws = workers(READY)
    busy = dict(wait_s=0.5, pressure=PressureLevel.ELEVATED, utilisation=0.9)
    scaler.tick([obs(ws, **busy)])
    clock.now_s = 5.0
    [decision] = scaler.tick([obs(ws, **busy)])
    assert (decision.reason, decision.num_workers) == (ScaleReason.PRESSURE, 1)
    clock.now_s = 10.0  # one is starting: pressure alone adds no second one
    assert scaler.tick([obs(workers(READY, STARTING), wait_s=0.5, queued=2, pressure=PressureLevel.CRITICAL)]) == []


def test_pressure_lingering_over_an_idle_pool_starts_nothing():
    clock = FakeClock()
    scaler = make(clock)
    ws = workers(READY)
    for t in (0.0, 5.0, 10.0):  # e.g. the dwell after a wait through a cold start: nothing queued, low use
        clock.now_s = t
        assert scaler.tick([obs(ws, pressure=PressureLevel.ELEVATED, utilisation=0.1)]) == []
    clock.now_s = 11.0
    scaler.tick([obs(ws, pressure=PressureLevel.ELEVATED, queued=1)])  # requests queue up: busy again
    clock.now_s = 16.0
    [decision] = scaler.tick([obs(ws, pressure=PressureLevel.ELEVATED, queued=1)])
    assert decision.reason is ScaleReason.PRESSURE


def test_scale_up_stops_at_max_workers():
    clock = FakeClock()
    scaler = make(clock, pool(max_workers=2))
    ws = workers(READY, READY)
    scaler.tick([obs(ws, wait_s=50.0)])
    clock.now_s = 60.0
    assert scaler.tick([obs(ws, wait_s=50.0, pressure=PressureLevel.CRITICAL)]) == []


def test_idle_pool_scales_to_zero_after_the_window():
    clock = FakeClock()
    scaler = make(clock)
    ws = workers(READY)
    assert scaler.tick([obs(ws)]) == []
    clock.now_s = 29.9
    assert scaler.tick([obs(ws)]) == []
    clock.now_s = 30.0
    [decision] = scaler.tick([obs(ws)])
    assert (decision.action, decision.reason, decision.worker_id) == (ScaleAction.DOWN, ScaleReason.IDLE, "w0")


def test_scale_down_respects_min_workers():
    clock = FakeClock()
    scaler = make(clock, pool(min_workers=1))
    scaler.tick([obs(workers(READY))])
    clock.now_s = 1000.0
    assert scaler.tick([obs(workers(READY))]) == []


def test_low_utilisation_drains_the_least_busy_newest_worker():
    clock = FakeClock()
    scaler = make(clock, scale_down_utilisation=0.5)
    ws = workers(READY, READY, READY, in_flight=(1, 0, 0))
    # 0.3 over 3 workers is 0.45 over 2: still low use
    scaler.tick([obs(ws, utilisation=0.3)])
    clock.now_s = 30.0
    [decision] = scaler.tick([obs(ws, utilisation=0.3)])
    assert (decision.reason, decision.worker_id) == (ScaleReason.LOW_UTILISATION, "w2")  # w1, w2 idle; w2 newer
    # the window restarts after the stop; the worker still draining (finishing its answers) does not hold it up
    ws = workers(READY, READY, DRAINING, in_flight=(1, 0, 1))
    clock.now_s = 59.9
    assert scaler.tick([obs(ws, utilisation=0.2)]) == []
    clock.now_s = 60.0
    [decision] = scaler.tick([obs(ws, utilisation=0.2)])  # 0.2 over 2 is 0.4 over 1: low
    assert (decision.reason, decision.worker_id) == (ScaleReason.LOW_UTILISATION, "w1")


def test_use_that_would_be_high_on_one_worker_fewer_is_not_low():
    clock = FakeClock()
    scaler = make(clock, scale_down_utilisation=0.5)
    ws = workers(READY, READY)
    scaler.tick([obs(ws, utilisation=0.3)])  # 0.3 × 2 ÷ 1 = 0.6 ≥ 0.5
    clock.now_s = 100.0
    assert scaler.tick([obs(ws, utilisation=0.3)]) == []
    one = workers(READY)
    scaler.tick([obs(one, utilisation=0.01)])  # a single worker in any use is not idle
    clock.now_s = 200.0
    assert scaler.tick([obs(one, utilisation=0.01)]) == []


def test_queued_requests_block_scale_down_and_pressure_lingering_without_a_queue_does_not():
    clock = FakeClock()
    scaler = make(clock)
    ws = workers(READY, READY)
    for t in (0.0, 30.0, 60.0):
        clock.now_s = t
        assert scaler.tick([obs(ws, wait_s=0.1, queued=1)]) == []
    # the queue is empty: the level still on its way down (hysteresis) does not hold the workers
    clock.now_s = 61.0
    assert scaler.tick([obs(ws, wait_s=0.1, pressure=PressureLevel.CRITICAL)]) == []  # low use starts now
    clock.now_s = 90.9
    assert scaler.tick([obs(ws, pressure=PressureLevel.ELEVATED)]) == []
    clock.now_s = 91.0
    assert [d.worker_id for d in scaler.tick([obs(ws, pressure=PressureLevel.ELEVATED)])] == ["w1"]


def test_remote_workers_serve_but_are_never_stopped_or_counted_against_max():
    clock = FakeClock()
    scaler = make(clock, pool(max_workers=1))
    remote = workers(READY, READY, local=False)
    scaler.tick([obs(remote, wait_s=4.0)])
    clock.now_s = 5.0
    [decision] = scaler.tick([obs(remote, wait_s=4.0)])
    assert decision.num_workers == 1  # ceil(2 × 4 ÷ 2) − 2 = 2, at least 1, capped by max_workers − 0 local = 1
    clock.now_s = 100.0
    scaler.tick([obs(remote)])
    clock.now_s = 200.0
    assert scaler.tick([obs(remote)]) == []  # idle, but none of them is ours to stop


def test_disabled_autoscaler_keeps_exactly_min_workers():
    clock = FakeClock()
    scaler = make(clock, pool(min_workers=2, max_workers=4), enabled=False)
    [decision] = scaler.tick([obs([], queued=1)])
    assert (decision.reason, decision.num_workers) == (ScaleReason.BELOW_MIN_WORKERS, 2)
    ws = workers(READY, READY)
    scaler.tick([obs(ws, wait_s=100.0, pressure=PressureLevel.CRITICAL)])
    clock.now_s = 1000.0
    assert scaler.tick([obs(ws, wait_s=100.0)]) == []
    assert scaler.tick([obs(ws)]) == []


def test_pools_are_decided_independently_and_events_are_kept():
    clock = FakeClock()
    scaler = make(clock, pool(name="big", min_workers=1), pool(name="small"), max_events=2)
    decisions = scaler.tick([obs([], name="big"), obs([], queued=2, name="small")])
    assert [(d.pool, d.reason) for d in decisions] == [
        ("big", ScaleReason.BELOW_MIN_WORKERS), ("small", ScaleReason.QUEUED_WITHOUT_WORKER)]
    scaler.tick([obs([], name="big")])
    assert [e["pool"] for e in scaler.snapshot()["events"]] == ["small", "big"]  # bounded at max_events
    with pytest.raises(KeyError):
        scaler.tick([obs([], name="nope")])


def test_measured_cold_start_feeds_the_predicted_wait():
    clock = FakeClock()
    scaler = make(clock)
    assert scaler.predicted_wait_s(obs([])) == 20.0  # nothing measured: the initial estimate
    scaler.record_cold_start("p", 8.0)
    scaler.record_cold_start("p", 12.0)
    assert scaler.cold_start_s("p") == 10.0
    assert scaler.predicted_wait_s(obs([])) == 10.0  # a full cold start
    clock.now_s = 7.0
    starting = [WorkerView("a", STARTING, started_at_s=3.0), WorkerView("b", STARTING, started_at_s=6.0)]
    assert scaler.predicted_wait_s(obs(starting)) == pytest.approx(6.0)  # 3 + 10 − 7, the earliest one
    clock.now_s = 30.0
    assert scaler.predicted_wait_s(obs(starting)) == 0.0
    assert scaler.predicted_wait_s(obs(workers(READY), wait_s=1.5)) == 1.5
    for seconds in (1.0, 1.0, 1.0, 1.0, 1.0):  # only the last COLD_START_SAMPLES count
        scaler.record_cold_start("p", seconds)
    assert scaler.cold_start_s("p") == 1.0
    assert scaler.snapshot()["pools"]["p"]["num_cold_starts"] == 7
    assert make(clock, pool(max_workers=0)).predicted_wait_s(obs([])) is None  # no worker will ever come


def test_worker_seconds_count_every_second_a_worker_exists():
    clock = FakeClock()
    meter = WorkerSecondsMeter(clock)
    meter.started("p", "a")
    clock.now_s = 10.0
    meter.started("p", "b")
    meter.started("p", "b")  # idempotent
    clock.now_s = 15.0
    meter.stopped("p", "a")
    meter.stopped("p", "ghost")
    assert meter.worker_seconds("p") == 20.0  # a: 15 s, b: 5 s so far
    clock.now_s = 20.0
    assert meter.worker_seconds("p") == 25.0
    assert meter.worker_seconds("other") == 0.0
    assert meter.pools() == ["p"]


def test_with_autoscaling_off_a_pool_below_min_still_expects_a_cold_start():
    scaler = make(FakeClock(), pool(min_workers=1, max_workers=4), enabled=False)
    assert scaler.predicted_wait_s(obs([])) == 20.0  # the missing min worker will be started
    assert make(FakeClock(), pool(min_workers=0), enabled=False).predicted_wait_s(obs([])) is None


def demand_obs(ws, demand_workers, queued=0, utilisation=0.0) -> PoolObservation:
    return PoolObservation("p", ws, None, queued, PressureLevel.NORMAL, utilisation, demand_workers)


def test_offered_load_starts_the_workers_it_needs_at_once_capped_by_max():
    clock = FakeClock()
    scaler = make(clock)
    # from zero: a queued request and a load of 2.3 workers start 3 at once (not one, then more later)
    [decision] = scaler.tick([demand_obs([], 2.3, queued=5)])
    assert (decision.reason, decision.num_workers) == (ScaleReason.QUEUED_WITHOUT_WORKER, 3)
    # one ready, one starting, load of 3.5 workers: start 2 more now, no sustain window
    [decision] = scaler.tick([demand_obs(workers(READY, STARTING), 3.5)])
    assert (decision.action, decision.reason, decision.num_workers) == (
        ScaleAction.UP, ScaleReason.DEMAND_ABOVE_CAPACITY, 2)
    # a load beyond max_workers: only up to max_workers (4)
    [decision] = scaler.tick([demand_obs(workers(READY, READY), 9.0)])
    assert decision.num_workers == 2
    # exactly enough ready and starting: nothing
    assert scaler.tick([demand_obs(workers(READY, READY, STARTING), 3.0)]) == []
    # from zero, the load grows while the first worker is still starting: the rest start now, not after it
    [decision] = scaler.tick([demand_obs(workers(STARTING), 3.2, queued=40)])
    assert (decision.reason, decision.num_workers) == (ScaleReason.DEMAND_ABOVE_CAPACITY, 3)


def test_offered_load_holds_workers_that_low_utilisation_would_stop():
    clock = FakeClock()
    scaler = make(clock, pool(scale_down_after_s=10.0))
    # low utilisation, but arrivals still need 2 workers: nobody is stopped, however long it lasts
    for now_s in (0.0, 20.0, 40.0):
        clock.now_s = now_s
        assert scaler.tick([demand_obs(workers(READY, READY), 1.5, utilisation=0.1)]) == []
    clock.now_s = 41.0
    assert scaler.tick([demand_obs(workers(READY, READY), 0.5, utilisation=0.1)]) == []  # the window starts
    clock.now_s = 51.0
    [decision] = scaler.tick([demand_obs(workers(READY, READY), 0.5, utilisation=0.1)])
    assert (decision.action, decision.reason) == (ScaleAction.DOWN, ScaleReason.LOW_UTILISATION)


def test_an_idle_pool_stops_one_worker_per_tick_after_the_window():
    clock = FakeClock()
    scaler = make(clock, pool(scale_down_after_s=10.0))
    assert scaler.tick([demand_obs(workers(READY, READY, READY), 0.0)]) == []
    clock.now_s = 10.0
    [first] = scaler.tick([demand_obs(workers(READY, READY, READY), 0.0)])
    assert (first.action, first.reason, first.worker_id) == (ScaleAction.DOWN, ScaleReason.IDLE, "w2")
    # the next tick, with the first one still draining, stops the next: no second window for an idle pool
    clock.now_s = 10.5
    [second] = scaler.tick([demand_obs(workers(READY, READY, DRAINING), 0.0)])
    assert (second.reason, second.worker_id) == (ScaleReason.IDLE, "w1")
    # a busy pool (any use) waits a full window after each stop
    scaler = make(clock, pool(scale_down_after_s=10.0), scale_down_utilisation=0.9)
    clock.now_s = 100.0
    assert scaler.tick([demand_obs(workers(READY, READY, READY), None, utilisation=0.2)]) == []
    clock.now_s = 110.0
    [decision] = scaler.tick([demand_obs(workers(READY, READY, READY), None, utilisation=0.2)])
    assert decision.reason is ScaleReason.LOW_UTILISATION
    clock.now_s = 110.5
    assert scaler.tick([demand_obs(workers(READY, READY), None, utilisation=0.2)]) == []
