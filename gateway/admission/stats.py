"""Typed snapshots of admission, the seam between admission and its readers (``/status``, Prometheus, the tier
counters shared through Redis): ``/status`` serializes them with msgspec; nothing reads a JSON dictionary back."""

from __future__ import annotations

import msgspec

from gateway.admission.pressure import PressureLevel, PressureStats
from gateway.admission.tickets import TierQueue


class TierStats(msgspec.Struct):
    """One tier's queue and counters.

    Attributes:
        priority: the tier's priority (larger first).
        queue_depth, queue_capacity: requests queued now; the most that may queue.
        oldest_wait_s: wait of the oldest queued request, seconds.
        in_flight, in_flight_kv_blocks: admitted requests not yet ended, and their KV demand in blocks.
        admitted, cancelled: requests admitted; queued requests whose client left.
        rejected: requests rejected or shed, by error code.
        predicted_wait_s: predicted wait of a request arriving now, seconds; None when unknown.
        dispatch_rate_per_s: requests of the tier dispatched per second over the rate window.
        preempted: its running requests stopped for a higher tier's, to resume later
            (:mod:`gateway.admission.preemption`).
        deferred: requests shed and served as an async job instead (202), by shed code; not in ``rejected``.
    """

    priority: int
    queue_depth: int
    queue_capacity: int
    oldest_wait_s: float
    in_flight: int
    in_flight_kv_blocks: int
    admitted: int
    rejected: dict[str, int]
    cancelled: int
    predicted_wait_s: float | None
    dispatch_rate_per_s: float
    preempted: int = 0
    deferred: dict[str, int] = {}


class AdmissionStats(msgspec.Struct, omit_defaults=True):
    """One pool's admission (or every pool's, merged per tier).

    Attributes:
        enabled: admission control is on (off: one FIFO queue, no deadlines or rate limits).
        order_policy: the dispatch order's name.
        draining: the gateway stopped admitting.
        drain_rate_tokens_per_s: the queues' drain rate, expected work tokens/s.
        expected_output_fraction: the measured share of ``max_tokens`` that answers use.
        pressure: the pressure level (merged: the highest of the pools').
        tiers: tier name → its stats (merged: counts summed, the longest oldest wait).
        pools: pool name → its own stats, in a merge of several pools; None for one pool.
    """

    enabled: bool
    order_policy: str
    draining: bool
    drain_rate_tokens_per_s: float
    expected_output_fraction: float
    pressure: PressureStats
    tiers: dict[str, TierStats]
    pools: dict[str, AdmissionStats] | None = None


def tier_stats(queue: TierQueue, now_s: float, predicted_wait_s: float | None,
               dispatch_rate_per_s: float, preempted: int = 0) -> TierStats:
    """Return the stats of one tier's queue at monotonic time ``now_s`` (rounded for ``/status``).

    Args:
        queue: the tier's queue and counters.
        now_s: monotonic seconds (the controller's clock).
        predicted_wait_s: the predicted wait of a request arriving now, seconds; None when unknown.
        dispatch_rate_per_s: requests of the tier dispatched per second over the rate window.
        preempted: its requests preempted so far.
    """
    head = queue.head()
    return TierStats(
        priority=queue.config.priority,
        queue_depth=len(queue.tickets),
        queue_capacity=queue.config.queue_capacity,
        oldest_wait_s=round(now_s - head.enqueued_s, 3) if head and head.enqueued_s is not None else 0.0,
        in_flight=queue.num_in_flight,
        in_flight_kv_blocks=queue.in_flight_blocks,
        admitted=queue.num_admitted,
        rejected=dict(queue.num_rejected),
        deferred=dict(queue.num_deferred),
        cancelled=queue.num_cancelled,
        predicted_wait_s=None if predicted_wait_s is None else round(predicted_wait_s, 3),
        dispatch_rate_per_s=round(dispatch_rate_per_s, 3),
        preempted=preempted,
    )


def merge_admission_stats(stats_by_pool: dict[str, AdmissionStats], default_pool: str) -> AdmissionStats:
    """Return the pools' admission stats merged per tier: counts and drain rates summed, the longest oldest wait,
    the highest pressure level; the rest from ``default_pool``. One pool: its stats as they are.

    Args:
        stats_by_pool: pool name → its stats (every pool has the same tiers).
        default_pool: the pool whose settings (and predicted waits) the merge keeps.
    """
    merged = stats_by_pool[default_pool]
    if len(stats_by_pool) == 1:
        return merged
    tiers = {name: msgspec.structs.replace(stats, rejected=dict(stats.rejected), deferred=dict(stats.deferred))
             for name, stats in merged.tiers.items()}
    drain_rate = merged.drain_rate_tokens_per_s
    pressure = merged.pressure
    for name, stats in stats_by_pool.items():
        if name == default_pool:
            continue
        drain_rate += stats.drain_rate_tokens_per_s
        if PressureLevel[stats.pressure.level.upper()] > PressureLevel[pressure.level.upper()]:
            pressure = stats.pressure
        for tier, other in stats.tiers.items():
            into = tiers[tier]
            into.queue_depth += other.queue_depth
            into.in_flight += other.in_flight
            into.in_flight_kv_blocks += other.in_flight_kv_blocks
            into.admitted += other.admitted
            into.cancelled += other.cancelled
            into.preempted += other.preempted
            into.oldest_wait_s = max(into.oldest_wait_s, other.oldest_wait_s)
            for reason, count in other.rejected.items():
                into.rejected[reason] = into.rejected.get(reason, 0) + count
            for reason, count in other.deferred.items():
                into.deferred[reason] = into.deferred.get(reason, 0) + count
    return msgspec.structs.replace(merged, drain_rate_tokens_per_s=drain_rate, pressure=pressure, tiers=tiers,
                                   pools=dict(stats_by_pool))
