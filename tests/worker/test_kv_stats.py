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
    defaults = {"prefix_hit_tokens", "prefix_query_tokens", "preemptions"}  # present before anything is counted
    assert defaults <= KV_STAT_COUNTERS
    assert {key.partition("{")[0] for key in KVStats().snapshot()} & KV_STAT_COUNTERS == defaults
    assert not {"tier_used_bytes", "tier_capacity_bytes", "redis_up", "pressure_level",
                "measured_bandwidth_bytes_per_s", "measured_prefill_tokens_per_s"} & KV_STAT_COUNTERS
