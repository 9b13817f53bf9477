"""The checks of the autoscaling bench (bench/autoscale_bench.py): medians over repeated side-by-side runs."""

from __future__ import annotations

import pytest

from bench.autoscale_bench import compare


def run(worker_seconds: float, attainment: dict[str, float], busy_worker_seconds: float = 0.0) -> dict:
    return {"worker_seconds": worker_seconds, "busy_worker_seconds": busy_worker_seconds,
            "summary": {"tiers": {tier: {"slo_attainment": value} for tier, value in attainment.items()}}}


def test_checks_compare_the_medians_of_the_repeats_and_list_each_one():
    pairs = [[run(50, {"vip": 1.0, "standard": 0.80, "free": 0.5}),
              run(100, {"vip": 1.0, "standard": 0.90, "free": 0.6}, 40)],
             [run(60, {"vip": 1.0, "standard": 0.90, "free": 0.6}),
              run(100, {"vip": 1.0, "standard": 0.85, "free": 0.55}, 40)],
             [run(70, {"vip": 0.99, "standard": 0.95, "free": 0.4}),
              run(100, {"vip": 1.0, "standard": 0.80, "free": 0.5}, 40)]]
    checks = compare(pairs)
    assert checks["repeats"] == 3
    assert checks["worker_seconds_ratio_by_repeat"] == pytest.approx([0.5, 0.6, 0.7])
    assert checks["worker_seconds_ratio"] == pytest.approx(0.6) and checks["worker_seconds_le_60pct"]
    assert checks["fixed_busy_share_of_worker_seconds"] == pytest.approx(0.4)
    # standard: medians 0.90 vs 0.85, though the first repeat alone was worse
    assert checks["standard_attainment_autoscale"] == 0.90 and checks["standard_attainment_fixed"] == 0.85
    assert checks["standard_no_worse"]
    # free: median 0.5 vs 0.55; vip: median 1.0 vs 1.0 (equal is no worse)
    assert checks["free_attainment_autoscale_by_repeat"] == [0.5, 0.6, 0.4] and not checks["free_no_worse"]
    assert checks["vip_no_worse"]


def test_a_repeat_over_the_worker_seconds_target_fails_the_median_check():
    pairs = [[run(61, {"vip": 1.0}), run(100, {"vip": 1.0})]]
    checks = compare(pairs)
    assert checks["worker_seconds_ratio"] == pytest.approx(0.61) and not checks["worker_seconds_le_60pct"]
    assert checks["standard_attainment_autoscale"] is None and not checks["standard_no_worse"]
