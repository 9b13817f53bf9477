"""Gateway metrics: the scrape-time export of admission and worker state (names, labels, kv_stats keys)."""

from __future__ import annotations

from gateway.admission.pressure import PressureStats
from gateway.admission.stats import AdmissionStats, TierStats
from gateway.metrics import Metrics, parse_kv_stat_key
from gateway.workers.status import WorkerStatus


def test_kv_stat_keys_become_metric_suffixes_and_labels():
    assert parse_kv_stat_key("evictions") == ("evictions", {})
    assert parse_kv_stat_key("prefix_hit_tokens{tier=host}") == ("prefix_hit_tokens", {"tier": "host"})
    assert parse_kv_stat_key("offload_bytes{tier=disk,direction=out}") == (
        "offload_bytes", {"tier": "disk", "direction": "out"})
    assert parse_kv_stat_key("odd-name.x") == ("odd_name_x", {})


def _admission_stats() -> AdmissionStats:
    pressure = PressureStats(level="elevated", in_level_s=0.0, queue_wait_s=0.0, kv_used_fraction=0.0,
                             num_transitions=0)
    vip = TierStats(priority=3, queue_depth=2, queue_capacity=8, oldest_wait_s=1.5, in_flight=0, in_flight_kv_blocks=0,
                    admitted=7, rejected={"queue_full": 3, "queue_timeout": 1}, cancelled=1, predicted_wait_s=None,
                    dispatch_rate_per_s=0.0)
    return AdmissionStats(enabled=True, order_policy="priority_aging", draining=False, drain_rate_tokens_per_s=123.0,
                          expected_output_fraction=1.0, pressure=pressure, tiers={"vip": vip})


def _worker_status() -> list[WorkerStatus]:
    capacity = {"decode_tokens_per_s": 40.0, "prefill_tokens_per_s": 900.0,
                "kv_stats": {"evictions{policy=lru}": 5.0, "usage": 0.5, "preemptions{mode=swap}": 1.0,
                             "preemptions": 2.0}}
    return [
        _worker("w0", backend="sim", ready=True, breaker={"state": "open"},
                hello={"device": "sim:roofline", "model_id": "M"}, capacity=capacity),
        _worker("w1", backend="", ready=False, breaker={"state": "half_open"}, hello=None, capacity=None),
    ]


def _worker(name: str, **fields) -> WorkerStatus:
    return WorkerStatus(name=name, address="", simulator=fields["backend"] == "sim", in_flight=0, reservations=0,
                        pending_prefill=0, reserved_kv_blocks=0, connections=1, capacity_age_s=None, **fields)


def test_state_is_exported_at_scrape_time_with_backend_labels():
    metrics = Metrics()
    metrics.attach_state(_admission_stats, _worker_status)
    text = metrics.render().decode()
    for line in (
        "sluice_pressure_level 1.0",
        'sluice_queue_depth{tier="vip"} 2.0',
        'sluice_admitted_total{tier="vip"} 7.0',
        'sluice_rejected_total{reason="queue_full",tier="vip"} 3.0',
        'sluice_cancelled_total{tier="vip"} 1.0',
        'sluice_breaker_state{backend="sim",worker="w0"} 2.0',
        'sluice_breaker_state{backend="",worker="w1"} 1.0',
        'sluice_worker_ready{backend="sim",worker="w0"} 1.0',
        'sluice_worker_ready{backend="",worker="w1"} 0.0',
        'sluice_worker_info{backend="sim",device="sim:roofline",model="M",worker="w0"} 1.0',
        'sluice_worker_decode_tokens_per_second{backend="sim",worker="w0"} 40.0',
        'sluice_worker_kv_evictions{backend="sim",policy="lru",worker="w0"} 5.0',
        'sluice_worker_kv_preemptions_total{backend="sim",mode="swap",worker="w0"} 1.0',
        'sluice_worker_kv_preemptions_total{backend="sim",mode="",worker="w0"} 2.0',
        'sluice_worker_kv_stat_usage{backend="sim",worker="w0"} 0.5',  # never clashes with sluice_worker_kv_usage
    ):
        assert line in text, line
    assert metrics.render().count(b"# TYPE sluice_worker_kv_preemptions_total counter") == 1


def test_kv_totals_are_counters_ending_in_total_and_levels_stay_gauges():
    """User trial: ``reload_decisions_total``, ``reloaded_blocks``, ``offloaded_bytes`` and ``prefix_hit_tokens``
    only ever grow, but were exported as gauges (``rate()`` then misreads a worker restart)."""
    kv_stats = {"reload_decisions_total": 3.0, "reloaded_blocks{tier=host}": 4.0, "offloaded_bytes{tier=disk}": 5.0,
                "prefix_hit_tokens{tier=device}": 6.0, "tier_used_bytes{tier=host}": 7.0, "redis_up": 1.0,
                "block_lifetime_s_p50": 8.0}
    capacity = {"decode_tokens_per_s": 1.0, "prefill_tokens_per_s": 1.0, "kv_stats": kv_stats}
    metrics = Metrics()
    metrics.attach_state(_admission_stats, lambda: [
        _worker("w0", backend="cpu", ready=True, breaker={"state": "closed"}, hello=None, capacity=capacity)])
    text = metrics.render().decode()
    for line in (
        "# TYPE sluice_worker_kv_reload_decisions_total counter",
        'sluice_worker_kv_reload_decisions_total{backend="cpu",worker="w0"} 3.0',
        "# TYPE sluice_worker_kv_reloaded_blocks_total counter",
        'sluice_worker_kv_reloaded_blocks_total{backend="cpu",tier="host",worker="w0"} 4.0',
        "# TYPE sluice_worker_kv_offloaded_bytes_total counter",
        'sluice_worker_kv_offloaded_bytes_total{backend="cpu",tier="disk",worker="w0"} 5.0',
        "# TYPE sluice_worker_kv_prefix_hit_tokens_total counter",
        'sluice_worker_kv_prefix_hit_tokens_total{backend="cpu",tier="device",worker="w0"} 6.0',
        "# TYPE sluice_worker_kv_tier_used_bytes gauge",
        "# TYPE sluice_worker_kv_redis_up gauge",
        "# TYPE sluice_worker_kv_block_lifetime_s_p50 gauge",
    ):
        assert line in text, line
    assert "sluice_worker_kv_reloaded_blocks_created" not in text  # no start time made up at scrape time
