"""Pools of workers: local worker processes the autoscaler starts and drains, remote workers from the Redis registry,
admission per pool, and degrade routing to a lighter pool.

::

    request ── model ──▶ PoolRuntime "big" ── AdmissionController ── ElasticWorkerPool ── WorkerClient ──▶ workers
                │ tier.degrade_pool, pool "big" at pressure ≥ tier.degrade_at
                └──────▶ PoolRuntime "small" ── …            (response model = "small", x-sluice-degraded: 1)

    Fleet
      autoscale loop: every autoscale.interval_s (and at once when a request finds no worker)
          observe each pool → Autoscaler.tick → spawn `sluice worker` | drain one, stop it once empty
      registry task:  RegistryWatcher.events() → RegistryMembers: join → connect, add to the pool serving its
                                                 model; leave → route nothing new to it, close it once its
                                                 requests have ended (gateway.fleet.registry_members)

Each pool has its own :class:`~gateway.admission.controller.AdmissionController` over its own workers, so capacity,
queues, predicted waits and pressure are per pool and model, in KV blocks from that pool's workers' reports: an idle
pool never hides a saturated one. The per-key rate limiter is one for all pools (a key's limits are the key's,
whatever model it asks for), in Redis when ``[ratelimit] backend = "redis"`` so that several gateways share it.

The fleet is a facade over small parts that talk through callbacks: :class:`~gateway.fleet.pools.PoolRuntime` (one
per pool), :class:`~gateway.fleet.scaling.ScalingLoop` (the autoscale loop, the arrival kick, the cold-start check),
:class:`~gateway.fleet.local_processes.LocalProcesses` (spawn, supervise, drain, stop), the registry watcher
(:mod:`gateway.fleet.registry_watch`) and :class:`~gateway.fleet.reporting.FleetReport` (``/status``, metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from prometheus_client import Histogram

from gateway.admission.caps import OutputCapper
from gateway.admission.controller import AdmissionController
from gateway.admission.pressure import PressureLevel, PressureMonitor
from gateway.admission.stats import AdmissionStats
from gateway.admission.ratelimit import RateLimiter, TokenBucketRateLimiter
from gateway.fleet.autoscaler import Autoscaler, WorkerSecondsMeter
from gateway.fleet.local_processes import LocalProcesses
from gateway.fleet.pools import ElasticWorkerPool, LocalWorker, PoolRuntime, Route
from gateway.fleet.registry_members import RegistryMembers
from gateway.fleet.registry_watch import RegistryWatcher
from gateway.fleet.reporting import FleetCollector, FleetReport
from gateway.fleet.scaling import ScalingLoop
from gateway.fleet.spawn import WorkerSpawner, preload_modules
from gateway.metrics import Metrics
from gateway.upstream.pool_config import make_upstream_client
from gateway.workers.client import WorkerClient
from gateway.workers.pool import WorkerPool
from gateway.workers.status import WorkerStatus
from shared.auth import load_secret
from shared.config import Config, PoolConfig, TierConfig, effective_pools, effective_tiers, validate_pool_config
from shared.errors import SluiceError, model_not_found

log = structlog.get_logger("sluice.gateway")

_COLD_START_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class Fleet:
    """The pools, their workers, the autoscaler and the registry watcher of one gateway.

    Args:
        config: the whole config (pools, autoscale, registry, ratelimit, tiers).
        metrics: the gateway's metrics (its registry gets the fleet's collector and histogram).
        config_path: passed to spawned workers as ``--config`` (None: their default resolution).
        spawn_local: start local workers (False: only ``worker_addresses`` and registry workers serve).
        worker_addresses: running workers to connect to, in the first pool.
        limiter: the per-key rate limiter shared by all pools; None = from ``[ratelimit]``.
        default_capper: the output capper of the first pool (the app's, whose pressure monitor the first pool's
            admission then shares); None = a new one.
        clock: monotonic seconds (the event loop's time base; injectable for tests).

    Raises:
        ConfigError: invalid pools or tiers, or an unreadable or too short ``worker.secret``/``secret_file``.
    """

    def __init__(self, config: Config, metrics: Metrics, config_path: str | None = None, spawn_local: bool = True,
                 worker_addresses: Sequence[str] = (), limiter: RateLimiter | None = None,
                 default_capper: OutputCapper | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        validate_pool_config(config)
        self._worker_secret = load_secret(config.worker)  # required of registry and --worker-address workers
        self.config = config
        self.metrics = metrics
        self.config_path = config_path
        self.spawn_local = spawn_local
        self._clock = clock
        self._pool_configs = effective_pools(config)
        self._tiers = {tier.name: tier for tier in effective_tiers(config)}
        self.autoscaler = Autoscaler(self._pool_configs, config.autoscale, clock)
        self.meter = WorkerSecondsMeter(clock)
        self.cold_start_hist = Histogram("sluice_worker_cold_start_seconds", "Local worker spawn to Hello",
                                         ["pool"], buckets=_COLD_START_BUCKETS_S, registry=metrics.registry)
        spawner = WorkerSpawner(config.gateway.worker_start_method,
                                preload_modules(pool.backend for pool in self._pool_configs
                                                if pool.backend != "openai"))
        self.local = LocalProcesses(config, metrics, self.meter, spawner, clock, config_path, self._on_cold_start,
                                    self._on_local_exit, secret=self._worker_secret)
        self._any_local_ready = False
        # set once no pool can ever serve (see startup_failure); `sluice serve` then exits with the reason
        self.unservable = asyncio.Event()
        self.unservable_reason: str | None = None
        self._spawner = spawner
        self._owned_limiter = limiter is None
        self.limiter = limiter if limiter is not None else self._make_limiter(config)
        self.runtimes: dict[str, PoolRuntime] = {}
        self.scaling = ScalingLoop(config, self.runtimes, self._tiers, self.autoscaler, self.local, spawn_local, clock)
        for i, pool_config in enumerate(self._pool_configs):
            capper = default_capper if i == 0 and default_capper is not None else None
            self.runtimes[pool_config.name] = self._make_runtime(pool_config, capper)
        self.default = self.runtimes[self._pool_configs[0].name]
        for i, address in enumerate(worker_addresses):
            self._add_remote(self.default, f"remote-{i}", address)
        self.degraded: Counter[tuple[str, str]] = Counter()  # (tier, pool that answered)
        self._registry_task: asyncio.Task | None = None
        self._watcher: RegistryWatcher | None = None
        self._members = RegistryMembers(self.runtimes, self._add_remote, self.model_names, clock)
        self.report = FleetReport(config, self.runtimes, self.default, self.autoscaler, self.meter,
                                  self.scaling.scale_events, self.degraded, clock)
        self.report.registry_health = lambda: None if self._watcher is None else self._watcher.health()
        metrics.registry.register(FleetCollector(self.report, self.degraded))

    @staticmethod
    def _make_limiter(config: Config) -> RateLimiter:
        if config.ratelimit.backend == "redis":
            from gateway.admission.redis_ratelimit import RedisRateLimiter

            return RedisRateLimiter.from_config(config.ratelimit, config.registry.redis_url)
        return TokenBucketRateLimiter()

    def _make_runtime(self, pool_config: PoolConfig, capper: OutputCapper | None) -> PoolRuntime:
        holder: list[PoolRuntime] = []
        pool = ElasticWorkerPool(pool_config.name, lambda: self.scaling.prospective_kv_blocks(holder[0]))
        pool.prefill_queue_s = self.config.admission.worker_prefill_queue_s
        if self.config.admission.enabled:  # off: every request goes with priority 0, and workers prefill in order
            pool.tier_priorities = {tier.name: tier.priority for tier in effective_tiers(self.config)}
        if capper is None or capper.pressure_monitor is None:
            capper = OutputCapper(self.config, PressureMonitor(self.config.pressure, self._clock))
        admission = AdmissionController(self.config, pool, pressure=capper.pressure_monitor, limiter=self.limiter,
                                        clock=self._clock)
        pool.on_change = admission.on_capacity_changed
        runtime = PoolRuntime(pool_config, pool, admission, capper,
                              watches_registry=bool(self.config.registry.redis_url))
        admission.on_arrival = lambda: self.scaling.on_arrival(runtime)
        holder.append(runtime)
        if pool_config.backend == "openai":
            for i, url in enumerate(pool_config.upstreams):
                name = f"{pool_config.name}-upstream-{i}"
                client = make_upstream_client(pool_config, url, name, self.config, self.metrics.observe_capacity,
                                              WorkerPool.make_breaker(self.config.breaker))
                runtime.remote[name] = (client, self._clock())
                pool.add_client(client)
        return runtime

    def start(self) -> None:
        """Connect to known workers, start the autoscale loop and the registry watcher (tasks owned here)."""
        for runtime in self.runtimes.values():
            for client, _ in runtime.remote.values():
                client.start()
        if self.spawn_local:
            if any(self.scaling.max_local(runtime) > 0 for runtime in self.runtimes.values()):
                self._spawner.warm_up()
            self.scaling.start()
        if self.config.registry.redis_url:
            self._watcher = RegistryWatcher.from_config(self.config.registry)
            self._registry_task = asyncio.create_task(self._watch_registry(), name="registry-watcher")

    async def close(self) -> None:
        """Shed queued requests, stop the loops, stop every local worker (SIGTERM), close every connection."""
        self.local.closing = True
        self.start_draining()
        await self.scaling.stop()
        if self._registry_task is not None:
            self._registry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._registry_task
        await self._members.close()
        await self.local.close(list(self.runtimes.values()))
        for runtime in self.runtimes.values():
            runtime.pool.on_change = None
            await runtime.pool.close()
        if self._watcher is not None:
            await self._watcher.close()
        if self._owned_limiter:
            await self.limiter.close()
        self._spawner.close()

    def start_draining(self) -> None:
        """Stop admitting in every pool: queued requests and new ones get 503 ``server_draining`` (SIGTERM)."""
        for runtime in self.runtimes.values():
            runtime.admission.start_draining()

    def fail_requests(self, error: SluiceError) -> int:
        """End every request in flight on every worker with ``error`` (:meth:`WorkerClient.fail_requests`); return
        how many."""
        return sum(client.fail_requests(error) for runtime in self.runtimes.values() for client in runtime.pool.clients)

    @property
    def draining(self) -> bool:
        """Whether the gateway stopped admitting."""
        return self.default.admission.draining

    def kick(self) -> None:
        """Run the autoscaler now instead of at the next interval."""
        self.scaling.kick()

    def autoscale_tick(self) -> None:
        """Run one autoscaler pass over every pool (see :meth:`ScalingLoop.autoscale_tick`)."""
        self.scaling.autoscale_tick()

    def max_sequence_slots(self, runtime: PoolRuntime) -> int | None:
        """See :meth:`ScalingLoop.max_sequence_slots`."""
        return self.scaling.max_sequence_slots(runtime)

    def can_cold_start(self, runtime: PoolRuntime) -> bool:
        """Return whether the pool has no ready worker and this gateway may start one (the job runner's gate lets
        a job through to such a pool: :class:`gateway.jobs.idle_capacity.FleetIdleCapacity`)."""
        return not runtime.has_ready_worker() and self.scaling.may_spawn(runtime)

    def check_cold_start(self, runtime: PoolRuntime, tier: str, count_rejection: bool = True) -> None:
        """Before queueing for a pool with no ready worker: start one now; reject when it comes too late (see
        :meth:`ScalingLoop.check_cold_start`).

        Raises:
            SluiceError: 503 when the cold start cannot make the tier's deadline, or no worker can come.
        """
        self.scaling.check_cold_start(runtime, tier, count_rejection)

    @property
    def scale_events(self) -> Counter[tuple[str, str, str]]:
        """Autoscaler actions carried out, by (pool, action, reason)."""
        return self.scaling.scale_events

    def _on_cold_start(self, pool: str, cold_start_s: float) -> None:
        self._any_local_ready = True
        self.autoscaler.record_cold_start(pool, cold_start_s)
        self.cold_start_hist.labels(pool).observe(cold_start_s)

    def _on_local_exit(self) -> None:
        self.kick()
        for runtime in self.runtimes.values():
            self.scaling.shed_if_unservable(runtime)
        reason = self.startup_failure()
        if reason is not None and not self.unservable.is_set():
            self.unservable_reason = reason
            self.unservable.set()

    def startup_failure(self) -> str | None:
        """Return why no pool can ever serve, when that is known at start: every pool's local workers stopped on a
        configuration error before any local worker was ready, no pool has a remote worker or upstream (nor a
        registry that could bring one), and no pool scales from zero; else None. A pool that scales from zero
        (``min_workers = 0``) made the gateway ready at start (``/readyz``) and starts its first worker for a
        request, so its failure comes while the gateway serves. Then, as for a pool whose workers stop so later,
        the gateway serves on: it answers the pool's requests with a 503 naming the error and reports it
        (``/readyz``, ``/status``)."""
        if self._any_local_ready or self.config.registry.redis_url:
            return None
        if any(runtime.config_error is None or runtime.remote or runtime.pool.clients
               or runtime.config.min_workers == 0 for runtime in self.runtimes.values()):
            return None
        return "; ".join(f"pool {runtime.name}: {runtime.config_error}" for runtime in self.runtimes.values())

    def config_errors(self) -> dict[str, str]:
        """Return, by pool, why its local workers are no longer started (a configuration error), for pools where
        one stopped so."""
        return {name: runtime.config_error for name, runtime in self.runtimes.items()
                if runtime.config_error is not None}

    def runtime_for_model(self, model: str) -> PoolRuntime:
        """Return the pool serving ``model``.

        Raises:
            SluiceError: ``model_not_found`` (404) naming the served models.
        """
        for runtime in self.runtimes.values():
            if runtime.config.model_name == model:
                return runtime
        raise model_not_found(model, self.model_names())

    def model_names(self) -> list[str]:
        """Return the served model ids, one per pool, in config order (duplicates once)."""
        return list(dict.fromkeys(runtime.config.model_name for runtime in self.runtimes.values()))

    def route(self, model: str, tier: TierConfig, serves: Callable[[PoolRuntime], bool] | None = None) -> Route:
        """Pick the pool of a request: its model's, or its tier's ``degrade_pool`` under the configured pressure when
        that pool has a worker that can take it now (ready, breaker not open: a degrade pool that is down or still
        starting sends nothing away from the model's own pool) and ``serves`` the request (e.g. not a pool of upstream
        engines for a request that wants ``logprobs``, which they do not pass through).

        Raises:
            SluiceError: ``model_not_found`` for an unknown model.
        """
        requested = self.runtime_for_model(model)
        if tier.degrade_pool and tier.degrade_pool != requested.name and self.config.admission.enabled:
            threshold = PressureLevel[tier.degrade_at.upper()]
            target = self.runtimes[tier.degrade_pool]
            if (requested.pressure.level >= threshold and target.has_serving_worker()
                    and (serves is None or serves(target))):
                target.degraded_in[tier.name] += 1
                self.degraded[(tier.name, target.name)] += 1
                return Route(target, True, requested)
        return Route(requested, False, requested)

    def _add_remote(self, runtime: PoolRuntime, name: str, address: str) -> WorkerClient:
        client = WorkerClient(address, name, self.metrics.observe_capacity,
                              WorkerPool.make_breaker(self.config.breaker), secret=self._worker_secret)
        runtime.remote[name] = (client, self._clock())
        runtime.pool.add_client(client)
        return client

    async def _watch_registry(self) -> None:
        async for event in self._watcher.events():
            await self._members.apply(event)
            self.kick()

    def is_ready(self) -> bool:
        """Return whether requests can be served: a pool can serve (:meth:`can_serve`)."""
        return any(self.can_serve(runtime) for runtime in self.runtimes.values())

    def can_serve(self, runtime: PoolRuntime) -> bool:
        """Return whether the pool can serve requests: a worker is ready and its breaker not open, or the pool scales
        from zero (min_workers = 0) and can start one (requests then wait through its cold start)."""
        return runtime.has_serving_worker() or (runtime.config.min_workers == 0 and self.scaling.may_spawn(runtime))

    def worker_status(self) -> list[WorkerStatus]:
        """Return every worker of every pool (see :meth:`FleetReport.worker_status`)."""
        return self.report.worker_status()

    def local_worker_status(self) -> list[dict]:
        """Return every local worker process, by pool then slot (``/status`` ``local_workers``)."""
        return self.report.local_worker_status()

    def admission_stats(self) -> AdmissionStats:
        """Return the pools' admission stats merged per tier (see :meth:`FleetReport.admission_stats`)."""
        return self.report.admission_stats()

    def snapshot(self) -> dict[str, Any]:
        """Return the pools, scale events and recent decisions for ``/status`` (see :meth:`FleetReport.snapshot`)."""
        return self.report.snapshot()


__all__ = ["ElasticWorkerPool", "Fleet", "FleetCollector", "LocalWorker", "PoolRuntime", "Route"]
