"""PressureMonitor: level transitions with hysteresis and dwell time, and each level's policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.admission.pressure import PressureLevel, PressureMonitor
from shared.config import Config, PressureConfig, PressureLevelConfig, load_config

ELEVATED = PressureLevelConfig(
    enter_queue_wait_s=2.0,
    leave_queue_wait_s=1.0,
    enter_kv_used_fraction=0.85,
    leave_kv_used_fraction=0.75,
    max_tokens_by_tier={"free": 256},
    queue_timeout_s_by_tier={"free": 15.0},
)
CRITICAL = PressureLevelConfig(
    enter_queue_wait_s=8.0,
    leave_queue_wait_s=4.0,
    enter_kv_used_fraction=0.95,
    leave_kv_used_fraction=0.9,
    max_tokens_by_tier={"free": 64, "vip": 1024},
    queue_timeout_s_by_tier={"free": 5.0},
    shed_tiers=["batch"],
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def monitor(clock: FakeClock) -> PressureMonitor:
    return PressureMonitor(PressureConfig(min_dwell_s=5.0, elevated=ELEVATED, critical=CRITICAL), clock)


def test_starts_normal_with_the_tiers_own_settings(monitor: PressureMonitor):
    assert monitor.level is PressureLevel.NORMAL
    assert monitor.max_tokens_cap("free") is None
    assert monitor.queue_timeout_s("free", 30.0) == 30.0
    assert not monitor.sheds("batch")
    assert monitor.observe(queue_wait_s=1.9, kv_used_fraction=0.84) is PressureLevel.NORMAL


def test_enters_elevated_on_queue_wait_or_kv_usage(monitor: PressureMonitor, clock: FakeClock):
    assert monitor.observe(2.0, 0.1) is PressureLevel.ELEVATED
    other = PressureMonitor(PressureConfig(elevated=ELEVATED, critical=CRITICAL), clock)
    assert other.observe(0.0, 0.85) is PressureLevel.ELEVATED


def test_hysteresis_between_leave_and_enter_thresholds_keeps_the_level(monitor: PressureMonitor, clock: FakeClock):
    monitor.observe(3.0, 0.5)
    clock.now_s += 60.0
    # Below enter (2 s) but not below leave (1 s): stays elevated however long it lasts.
    assert monitor.observe(1.5, 0.5) is PressureLevel.ELEVATED
    assert monitor.observe(0.5, 0.8) is PressureLevel.ELEVATED  # KV 0.8 is not below leave 0.75
    assert monitor.observe(0.5, 0.7) is PressureLevel.NORMAL


def test_does_not_step_down_before_the_minimum_dwell(monitor: PressureMonitor, clock: FakeClock):
    monitor.observe(3.0, 0.0)
    clock.now_s += 4.9
    assert monitor.observe(0.0, 0.0) is PressureLevel.ELEVATED
    clock.now_s += 0.1
    assert monitor.seconds_until_may_step_down() == pytest.approx(0.0)
    assert monitor.observe(0.0, 0.0) is PressureLevel.NORMAL


def test_escalation_is_immediate_and_may_skip_a_level(monitor: PressureMonitor):
    assert monitor.observe(0.0, 0.96) is PressureLevel.CRITICAL
    assert monitor.num_transitions == 1


def test_steps_down_one_level_at_a_time(monitor: PressureMonitor, clock: FakeClock):
    monitor.observe(9.0, 0.0)
    clock.now_s += 5.0
    assert monitor.observe(0.0, 0.0) is PressureLevel.ELEVATED
    assert monitor.observe(0.0, 0.0) is PressureLevel.ELEVATED  # a new dwell starts in elevated
    clock.now_s += 5.0
    assert monitor.observe(0.0, 0.0) is PressureLevel.NORMAL


def test_escalates_from_elevated_to_critical_without_waiting_for_dwell(monitor: PressureMonitor):
    monitor.observe(2.5, 0.0)
    assert monitor.observe(8.0, 0.0) is PressureLevel.CRITICAL


def test_level_policies_give_caps_deadlines_and_shed_tiers(monitor: PressureMonitor, clock: FakeClock):
    monitor.observe(2.5, 0.0)
    assert monitor.max_tokens_cap("free") == 256
    assert monitor.max_tokens_cap("vip") is None
    assert monitor.queue_timeout_s("free", 30.0) == 15.0
    assert monitor.queue_timeout_s("free", 8.0) == 8.0  # a level tightens a tier's own deadline, never loosens it
    assert not monitor.sheds("batch")
    monitor.observe(8.5, 0.0)
    assert monitor.max_tokens_cap("free") == 64
    assert monitor.max_tokens_cap("vip") == 1024
    assert monitor.queue_timeout_s("free", 30.0) == 5.0
    assert monitor.queue_timeout_s("standard", 15.0) == 15.0
    assert monitor.sheds("batch") and not monitor.sheds("vip")
    snap = monitor.snapshot()
    assert snap["level"] == "critical" and snap["queue_wait_s"] == 8.5


def test_default_config_has_two_ordered_levels():
    config = Config()
    assert config.pressure.elevated.enter_queue_wait_s < config.pressure.critical.enter_queue_wait_s
    assert config.pressure.critical.shed_tiers == ["batch"]
    assert load_config(Path(__file__).parents[2] / "config.toml", environ={}).pressure == config.pressure
