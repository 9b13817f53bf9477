"""``worker.kv_cache.stats``: which ``Capacity.kv_stats`` names are totals (Prometheus counters) and which gauges."""

from __future__ import annotations

import pytest

from shared.protocol import KV_STAT_COUNTERS
from worker.kv_cache.stats import KVStats


def test_every_counted_name_is_a_listed_total_and_an_unlisted_one_is_refused():
    """The gateway exports the names of ``KV_STAT_COUNTERS`` as counters, every other name as a gauge: a counter
    the worker adds without listing it would be a gauge again."""
    stats = KVStats()
    for name in KV_STAT_COUNTERS:
        stats.add(name, 2.0, tier="host")
    with pytest.raises(ValueError, match="'reloaded_rows' is not listed in shared.protocol.KV_STAT_COUNTERS"):
        stats.add("reloaded_rows")
    stats.set_gauge("tier_used_bytes", 5.0, tier="host")
    snapshot = stats.snapshot()
    assert snapshot["reloaded_blocks{tier=host}"] == 2.0 and snapshot["tier_used_bytes{tier=host}"] == 5.0
    # present before anything is counted: those without labels, and those whose labels are known from the start
    defaults = {"prefix_hit_tokens", "prefix_query_tokens", "preemptions", "partial_block_hit_tokens", "expired_blocks",
                "reload_decisions_total", "recompute_decisions_total", "recompute_decision_tokens",
                "reload_verify_failures_total", "swapped_out_bytes", "swapped_in_bytes", "pressure_switches_total"}
    assert defaults <= KV_STAT_COUNTERS
    fresh = KVStats().snapshot()
    assert {key.partition("{")[0] for key in fresh} & KV_STAT_COUNTERS == defaults
    assert fresh["expired_blocks"] == 0.0 and fresh["pressure_switches_total{level=critical}"] == 0.0
    assert not {"tier_used_bytes", "tier_capacity_bytes", "redis_up", "pressure_level",
                "measured_bandwidth_bytes_per_s", "measured_prefill_tokens_per_s"} & KV_STAT_COUNTERS
