"""Per-tier counters shared by every gateway through Redis, so tier bounds hold across gateways.

Several gateways (processes sharing a port with ``gateway.reuse_port``, or machines) each run their own admission
queues. Every ``ratelimit.tier_counters_interval_s`` each gateway publishes its per-tier counts — requests queued and
in flight now, admitted and rejected (by reason) since it started — and, in the same atomic round trip, reads those
of every other live gateway. The sums are used three ways:

- ``/status`` ``fleet_tiers``: per tier the counts summed over the live gateways, and how many there are;
- ``/metrics``: ``sluice_fleet_tier_queued{tier}``, ``sluice_fleet_tier_in_flight{tier}``, ``sluice_fleet_gateways``;
- admission: a tier's ``queue_capacity`` bounds the requests of that tier queued on all gateways together
  (:meth:`TierCounters.queued_elsewhere` is the ``AdmissionController.queued_elsewhere`` hook). The other gateways'
  counts are at most about two intervals old, so the bound can be overshot by what arrives in between.

Layout (one Lua script, run atomically by Redis, on the Redis server's clock)::

    <key_prefix>                sorted set: gateway id → expiry of its counts (Redis TIME, ms)
    <key_prefix>:<gateway id>   JSON {tier: {queued, in_flight, admitted, rejected: {reason: count}}},
                                expires after TTL_INTERVALS intervals

A gateway that stops publishing (killed, partitioned) drops out after ``TTL_INTERVALS`` intervals; one that shuts
down cleanly removes itself at once. The script touches keys it derives from the prefix, so it needs a single Redis
(not Redis Cluster), like the rest of Sluice's Redis use.

When Redis fails, this gateway goes on with its own counts only (no queued requests elsewhere: queue bounds hold per
gateway again, service over strictness), logs once per failure and tries again every interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from gateway.admission.stats import AdmissionStats
from gateway.aio import wait_event
from shared.config import Config

log = structlog.get_logger("sluice.gateway")

# A gateway whose counts are older than this many intervals is no longer counted.
TTL_INTERVALS = 3

# KEYS[1]: the index (sorted set). ARGV: key prefix, gateway id, payload (JSON), ttl in ms.
# Returns a flat list {id, payload, id, payload, …} of the other live gateways.
_PUBLISH_AND_READ_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl_ms = tonumber(ARGV[4])
redis.call('SET', ARGV[1] .. ':' .. ARGV[2], ARGV[3], 'PX', ttl_ms)
redis.call('ZADD', KEYS[1], now_ms + ttl_ms, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], tonumber(last[2]))
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if id ~= ARGV[2] then
    local value = redis.call('GET', ARGV[1] .. ':' .. id)
    if value then
      table.insert(out, id)
      table.insert(out, value)
    end
  end
end
return out
"""


class TierCounts(msgspec.Struct, frozen=True):
    """One tier's counts on one gateway (or summed over gateways).

    Attributes:
        queued: requests waiting in the tier's queue now.
        in_flight: admitted requests not yet finished.
        admitted: requests admitted since the gateway started.
        rejected: reason (error code) → requests rejected or shed since the gateway started.
    """

    queued: int = 0
    in_flight: int = 0
    admitted: int = 0
    rejected: dict[str, int] = {}

    def plus(self, other: TierCounts) -> TierCounts:
        """Return the sum of both counts."""
        rejected = dict(self.rejected)
        for reason, count in other.rejected.items():
            rejected[reason] = rejected.get(reason, 0) + count
        return TierCounts(queued=self.queued + other.queued, in_flight=self.in_flight + other.in_flight,
                          admitted=self.admitted + other.admitted, rejected=rejected)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(dict[str, TierCounts])


def tier_counts_from_stats(stats: AdmissionStats) -> dict[str, TierCounts]:
    """Return tier name → counts of admission stats (``AdmissionController.stats`` or ``Fleet.admission_stats``:
    pools already summed per tier)."""
    return {
        name: TierCounts(queued=tier.queue_depth, in_flight=tier.in_flight, admitted=tier.admitted,
                         rejected=dict(tier.rejected))
        for name, tier in stats.tiers.items()
    }


class TierCounters:
    """Publish this gateway's per-tier counts to Redis and keep the other live gateways' (see the module docstring).

    Args:
        gateway_id: this gateway's id (also its key suffix); unique among the gateways sharing ``key_prefix``.
        local_counts: returns this gateway's counts now (tier name → :class:`TierCounts`).
        client: an asyncio Redis client (its socket timeout bounds each call); None = not shared, local counts only.
        key_prefix: prefix of the index and the per-gateway keys.
        interval_s: seconds between two publications (> 0).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        gateway_id: str,
        local_counts: Callable[[], dict[str, TierCounts]],
        client: aioredis.Redis | None = None,
        key_prefix: str = "sluice:tiers",
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway_id = gateway_id
        self._local_counts = local_counts
        self._client = client
        self._key_prefix = key_prefix
        self._interval_s = interval_s
        self._ttl_s = TTL_INTERVALS * interval_s
        self._clock = clock
        self._script = client.register_script(_PUBLISH_AND_READ_LUA) if client is not None else None
        self._others: dict[str, dict[str, TierCounts]] = {}  # gateway id → its counts, as of the last sync
        self._queued_elsewhere_by_tier: dict[str, int] = {}
        self._others_valid_until_s = 0.0
        self._redis_ok = True
        self.num_redis_errors = 0
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        # the longest a publication in flight is awaited at close: a little over the client's socket timeout
        socket_timeout_s = client.connection_pool.connection_kwargs.get("socket_timeout") if client else None
        self._close_wait_s = (socket_timeout_s or 1.0) + 0.5

    @classmethod
    def from_config(cls, config: Config, gateway_id: str,
                    local_counts: Callable[[], dict[str, TierCounts]]) -> TierCounters:
        """Build the counters of ``[ratelimit]``: shared through its ``redis_url`` (else ``registry.redis_url``)
        when ``share_tier_counters`` is on and a URL is set; local only otherwise."""
        settings = config.ratelimit
        url = settings.redis_url or config.registry.redis_url
        client = None
        if settings.share_tier_counters and url:
            client = aioredis.Redis.from_url(url, socket_timeout=settings.timeout_s,
                                             socket_connect_timeout=settings.timeout_s)
        return cls(gateway_id, local_counts, client, settings.tier_counters_key_prefix,
                   settings.tier_counters_interval_s)

    @property
    def shared(self) -> bool:
        """Whether counts go through Redis at all."""
        return self._client is not None

    def start(self) -> None:
        """Start publishing every interval (a task owned here, stopped by :meth:`close`); a no-op when not shared."""
        if self._client is not None and self._task is None:
            self._task = asyncio.create_task(self._run(), name="tier-counters")

    async def close(self) -> None:
        """Stop publishing, remove this gateway's counts from Redis (best effort) and close the connection pool.

        A publication in flight is let finish first (up to the client's socket timeout): cancelling it would not
        take back a script Redis has already received, which could then run after the removal and leave this
        gateway's entry in the index until it expires."""
        if self._task is not None:
            self._stopping.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self._close_wait_s)
            except asyncio.TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        if self._client is None:
            return
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(f"{self._key_prefix}:{self.gateway_id}")
                pipe.zrem(self._key_prefix, self.gateway_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.info("tier_counters_not_removed", gateway_id=self.gateway_id, error=str(exc))
        await self._client.aclose()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            await self.sync_once()
            await wait_event(self._stopping, self._interval_s)

    async def sync_once(self) -> bool:
        """Publish this gateway's counts and read the other live gateways' (one Redis round trip).

        Returns:
            True when Redis answered; False when it failed (the other gateways are then forgotten) or is not used.
        """
        if self._script is None:
            return False
        payload = _ENCODER.encode(self._local_counts())
        ttl_ms = max(1, round(self._ttl_s * 1000))
        try:
            reply = await self._script(keys=[self._key_prefix], args=[self._key_prefix, self.gateway_id, payload,
                                                                       ttl_ms])
        except (RedisError, OSError) as exc:
            self._on_error(exc)
            return False
        others: dict[str, dict[str, TierCounts]] = {}
        for raw_id, raw_counts in zip(reply[0::2], reply[1::2]):
            gateway_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            try:
                others[gateway_id] = _DECODER.decode(raw_counts)
            except msgspec.DecodeError as exc:
                log.warning("tier_counters_bad_entry", gateway_id=gateway_id, error=str(exc))
        self._set_others(others, self._clock() + self._ttl_s)
        if not self._redis_ok:
            log.info("tier_counters_redis_recovered", gateway_id=self.gateway_id, num_other_gateways=len(others))
        self._redis_ok = True
        return True

    def _on_error(self, exc: BaseException) -> None:
        self.num_redis_errors += 1
        self._set_others({}, 0.0)
        if self._redis_ok:
            log.warning("tier_counters_redis_failed_counting_locally", gateway_id=self.gateway_id, error=str(exc),
                        retry_in_s=self._interval_s)
        self._redis_ok = False

    def _set_others(self, others: dict[str, dict[str, TierCounts]], valid_until_s: float) -> None:
        self._others = others
        self._others_valid_until_s = valid_until_s
        queued: dict[str, int] = {}
        for tiers in others.values():
            for tier, counts in tiers.items():
                queued[tier] = queued.get(tier, 0) + counts.queued
        self._queued_elsewhere_by_tier = queued

    def _live_others(self) -> dict[str, dict[str, TierCounts]]:
        """The other gateways' counts, or none when the last successful sync is older than the TTL."""
        return self._others if self._clock() < self._others_valid_until_s else {}

    def queued_elsewhere(self, tier: str) -> int:
        """Return the requests of ``tier`` queued on the other live gateways (0 when not shared or Redis failed).

        The ``AdmissionController.queued_elsewhere`` hook: called at every arrival, O(1).
        """
        if self._clock() >= self._others_valid_until_s:
            return 0
        return self._queued_elsewhere_by_tier.get(tier, 0)

    def fleet_counts(self) -> tuple[dict[str, TierCounts], dict[str, int]]:
        """Return tier → counts summed over the live gateways (this one's fresh), and tier → live gateways counting
        that tier (this one included)."""
        totals = dict(self._local_counts())
        num_gateways = dict.fromkeys(totals, 1)
        for tiers in self._live_others().values():
            for tier, counts in tiers.items():
                totals[tier] = totals[tier].plus(counts) if tier in totals else counts
                num_gateways[tier] = num_gateways.get(tier, 0) + 1
        return totals, num_gateways

    def snapshot(self) -> dict[str, Any]:
        """Return the ``/status`` ``fleet_tiers`` section: whether counts are shared and Redis answers, the live
        gateways, and per tier the summed counts with ``num_gateways``."""
        totals, num_gateways = self.fleet_counts()
        return {
            "shared": self.shared,
            "redis_ok": self.shared and self._redis_ok,
            "gateway_id": self.gateway_id,
            "gateways": sorted([self.gateway_id, *self._live_others()]),
            "tiers": {
                tier: {**msgspec.structs.asdict(counts), "num_gateways": num_gateways[tier]}
                for tier, counts in totals.items()
            },
        }


class TierCountersCollector:
    """Prometheus collector of the fleet-wide tier counts, read at scrape time.

    ``sluice_fleet_tier_queued{tier}``, ``sluice_fleet_tier_in_flight{tier}`` (summed over the live gateways) and
    ``sluice_fleet_gateways`` (live gateways sharing the counters, this one included).
    """

    def __init__(self, counters: TierCounters) -> None:
        self._counters = counters

    def collect(self) -> Iterable[Metric]:
        """Yield the metric families (called by the registry on every scrape)."""
        snapshot = self._counters.snapshot()
        queued = GaugeMetricFamily("sluice_fleet_tier_queued", "Requests queued per tier on all live gateways",
                                   labels=["tier"])
        in_flight = GaugeMetricFamily("sluice_fleet_tier_in_flight",
                                      "Requests in flight per tier on all live gateways", labels=["tier"])
        for tier, counts in snapshot["tiers"].items():
            queued.add_metric([tier], counts["queued"])
            in_flight.add_metric([tier], counts["in_flight"])
        gateways = GaugeMetricFamily("sluice_fleet_gateways", "Live gateways sharing tier counters (this one "
                                     "included)", value=len(snapshot["gateways"]))
        yield from (queued, in_flight, gateways)


__all__ = ["TTL_INTERVALS", "TierCounters", "TierCountersCollector", "TierCounts", "tier_counts_from_stats"]
