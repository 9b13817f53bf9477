"""Counters of the KV cache's lifetime decisions, reported in ``Capacity.kv_stats`` (issue 4, Metrics).

A snapshot is a flat ``dict[str, float]``. A key is a metric name, optionally followed by labels in braces, the
way Prometheus writes a sample: ``prefix_hit_tokens{tier=host}``, ``evicted_blocks{policy=lru,tier=free}``.
The names :meth:`KVStats.add` counts are monotonic counters since the worker started, each listed in
:data:`shared.protocol.KV_STAT_COUNTERS` (the gateway exports them as Prometheus counters); ``*_p50`` / ``*_p90``
are quantiles over the last :data:`RESERVOIR_SIZE` samples; ``*_used_bytes`` / ``*_capacity_bytes`` / ``redis_up``
and the other :meth:`KVStats.set_gauge` names are gauges.
"""

from __future__ import annotations

import collections
import statistics

from shared.protocol import KV_STAT_COUNTERS
from worker.kv_cache.eviction.retention import PRESSURE_LEVELS

# Totals in every snapshot from the start, at 0 until counted (a Prometheus series that first appears at its first
# count hides that increase from rate() and leaves a dashboard's panel empty): those without labels, and those whose
# labels are known before anything is counted. Counters labelled by policy or storage tier appear at their first
# count; redis_errors_total only with a Redis tier.
COUNTERS_FROM_START = ("prefix_query_tokens", "partial_block_hit_tokens", "expired_blocks", "reload_decisions_total",
                       "recompute_decisions_total", "recompute_decision_tokens", "reload_verify_failures_total",
                       "swapped_out_bytes", "swapped_in_bytes")

RESERVOIR_SIZE = 1024
STORAGE_TIERS = ("device", "host", "disk", "redis")


def labelled(name: str, **labels: str) -> str:
    """Return the snapshot key of ``name`` with ``labels`` (sorted by label name): ``name{a=x,b=y}``."""
    if not labels:
        return name
    return name + "{" + ",".join(f"{key}={labels[key]}" for key in sorted(labels)) + "}"


class _Summary:
    """Count, sum and recent quantiles of one quantity (bounded memory: the last ``RESERVOIR_SIZE`` samples)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=RESERVOIR_SIZE)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.recent.append(value)

    def items(self, name: str) -> dict[str, float]:
        out = {f"{name}_count": float(self.count), f"{name}_sum": self.total}
        if len(self.recent) >= 2:
            deciles = statistics.quantiles(self.recent, n=10)
            p50, p90 = deciles[4], deciles[8]
        elif self.recent:
            p50 = p90 = self.recent[0]
        else:
            p50 = p90 = 0.0
        out[f"{name}_p50"] = p50
        out[f"{name}_p90"] = p90
        return out


class KVStats:
    """Mutable counters of one worker's KV cache; :meth:`snapshot` makes the ``Capacity.kv_stats`` dict.

    Keys of the snapshot (tokens and bytes are totals since start):

    - ``prefix_query_tokens``: prompt tokens of first admissions (the denominator of every hit rate).
    - ``prefix_hit_tokens{tier=device|host|disk|redis}``: of those, tokens served from that storage tier.
    - ``partial_block_hit_tokens``: of the device hits, tokens whose K/V rows were copied out of a cached block
      that continues the matched chain (partial-block reuse).
    - ``evicted_blocks{policy=P,tier=T}``: device evictions by the policy in charge and the block's admission tier.
    - ``expired_blocks``: evicted device blocks past their retention, dropped instead of demoted.
    - ``offloaded_bytes{tier=S}``, ``offloaded_blocks{tier=S}``: blocks written into offload tier S.
    - ``reloaded_bytes{tier=S}``, ``reloaded_blocks{tier=S}``: blocks read back from S into the device pool.
    - ``offload_evicted_blocks{tier=S}``: blocks pushed out of S by its size bound (demoted or dropped).
    - ``offload_dropped_blocks{tier=disk|redis}``: demoted blocks not stored because the tier's writer queue was full.
    - ``reload_decisions_total`` / ``recompute_decisions_total``: lookups in the lower tiers that found blocks and
      chose to reload them / to recompute them (cost model); ``recompute_decision_tokens`` what that left to compute.
    - ``reload_verify_failures_total``: a reloaded block whose stored token ids did not match (treated as a miss).
    - ``preemptions{mode=swap|recompute}``; ``swapped_out_bytes``, ``swapped_in_bytes``.
    - ``block_lifetime_s_{count,sum,p50,p90}``: seconds a block stayed cached on the device (cached → evicted).
    - ``reuse_gap_s_{count,sum,p50,p90}``: seconds between a block's release and its reuse by a prefix hit.
    - ``redis_errors_total``, ``redis_up`` (1 or 0; absent without Redis).
    - ``pressure_switches_total{level=L}``: changes of the pressure level, by the level entered; ``pressure_level``
      (0 normal, 1 elevated, 2 critical; a gauge).
    - ``tier_used_bytes{tier=S}``, ``tier_capacity_bytes{tier=S}``: occupancy of each offload tier (gauges).
    - ``measured_bandwidth_bytes_per_s{tier=S}``, ``measured_prefill_tokens_per_s``: the cost model's estimates.
    """

    def __init__(self) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self.gauges: dict[str, float] = {}
        self.block_lifetime_s = _Summary()
        self.reuse_gap_s = _Summary()

    def add(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add ``value`` to the counter ``name{labels}``.

        Raises:
            ValueError: ``name`` is not in :data:`shared.protocol.KV_STAT_COUNTERS` (the gateway would export it
                as a gauge).
        """
        if name not in KV_STAT_COUNTERS:
            raise ValueError(f"KV counter {name!r} is not listed in shared.protocol.KV_STAT_COUNTERS")
        self.counters[labelled(name, **labels)] += value

    def set_gauge(self, name: str, value: float, **labels: str) -> None:
        self.gauges[labelled(name, **labels)] = float(value)

    def get(self, name: str, **labels: str) -> float:
        """Return the counter ``name{labels}`` (0 when never counted)."""
        return float(self.counters.get(labelled(name, **labels), 0.0))

    def snapshot(self) -> dict[str, float]:
        """Return every counter, gauge and summary as one flat dict (see the class docstring for the keys)."""
        out = {key: float(value) for key, value in self.counters.items()}
        for name in COUNTERS_FROM_START:
            out.setdefault(name, 0.0)
        for tier in STORAGE_TIERS:
            out.setdefault(labelled("prefix_hit_tokens", tier=tier), 0.0)
        for mode in ("swap", "recompute"):
            out.setdefault(labelled("preemptions", mode=mode), 0.0)
        for level in PRESSURE_LEVELS:
            out.setdefault(labelled("pressure_switches_total", level=level), 0.0)
        out.update(self.gauges)
        out.update(self.block_lifetime_s.items("block_lifetime_s"))
        out.update(self.reuse_gap_s.items("reuse_gap_s"))
        return out
