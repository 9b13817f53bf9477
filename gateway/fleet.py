"""Pools of workers: local worker processes the autoscaler starts and drains, remote workers from the Redis registry,
admission per pool, and degrade routing to a lighter pool (issue 7).

::

    request ── model ──▶ PoolRuntime "big" ── AdmissionController ── ElasticWorkerPool ── WorkerClient ──▶ workers
                │ tier.degrade_pool, pool "big" at pressure ≥ tier.degrade_at
                └──────▶ PoolRuntime "small" ── …            (response model = "small", x-sluice-degraded: 1)

    Fleet
      autoscale loop: every autoscale.interval_s (and at once when a request finds no worker)
          observe each pool → Autoscaler.tick → spawn `sluice worker` | drain one, stop it once empty
      registry task:  RegistryWatcher.events() → join: connect, add to the pool serving its model
                                                 leave: remove from the pool, close (requests not yet streaming
                                                 are retried on another worker by gateway.generation)

Each pool has its own :class:`~gateway.admission.AdmissionController` over its own workers, so capacity, queues,
predicted waits and pressure are per pool and model, in KV blocks from that pool's workers' reports: an idle pool
never hides a saturated one. The per-key rate limiter is one for all pools (a key's limits are the key's, whatever
model it asks for), in Redis when ``[ratelimit] backend = "redis"`` so that several gateways share it.

A pool that may start a worker (or has one starting) announces the KV capacity of its last worker (one block before
any) to admission, so a request that finds no worker waits in its tier queue through the cold start, with its
deadline; :meth:`Fleet.check_cold_start` rejects it at once with 503 and ``Retry-After`` (the cold start left)
when the measured cold start cannot make its deadline.

A scale-down never aborts a request: the worker is marked draining in the gateway (no new reservation), sent the
protocol's ``Drain``, and stopped (SIGTERM) only once every request of this gateway on it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.admission import AdmissionController
from gateway.autoscaler import (
    Autoscaler,
    PoolObservation,
    ScaleAction,
    ScaleDecision,
    ScaleReason,
    WorkerSecondsMeter,
    WorkerState,
    WorkerView,
)
from gateway.caps import OutputCapper
from gateway.local_workers import STOP_GRACE_S
from gateway.metrics import Metrics
from gateway.pressure import PressureLevel, PressureMonitor
from gateway.ratelimit import RateLimiter, TokenBucketRateLimiter
from gateway.spawn import WorkerProcess, WorkerSpawner, preload_modules
from gateway.workers import FIRST_CONNECT_INTERVAL_S, WorkerClient, WorkerPool
from shared.config import Config, PoolConfig, TierConfig, effective_pools, effective_tiers, validate_pool_config
from shared.errors import ErrorCode, SluiceError

log = structlog.get_logger("sluice.gateway")

# Seconds between two checks of a draining worker's remaining requests.
DRAIN_POLL_S = 0.05
# Longest wait, seconds, for requests admitted to a worker just before it was marked draining to be sent to it.
DRAIN_DISPATCH_WAIT_S = 2.0
# Longest pause before a new spawn after workers of a pool kept failing to start, seconds.
MAX_SPAWN_BACKOFF_S = 60.0
_COLD_START_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# Share of ``autoscale.demand_window_s`` over which a burst's arrival rate is also measured (Knative's panic window).
PANIC_WINDOW_FRACTION = 0.1
# Least seconds between two looks at a pool's offered load on arrival (``Fleet._on_arrival``): a burst of hundreds
# of requests a second costs at most this many demand sums, not one per request.
ARRIVAL_CHECK_INTERVAL_S = 0.05
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


class ElasticWorkerPool(WorkerPool):
    """A :class:`WorkerPool` whose workers come and go, and that admits requests through a cold start.

    Args:
        name: the pool's name.
        prospective_kv_blocks: KV blocks to announce when no worker can serve now but one is coming (0 = none is).
    """

    def __init__(self, name: str, prospective_kv_blocks: Callable[[], int] = lambda: 0) -> None:
        super().__init__([])
        self.name = name
        self._prospective_kv_blocks = prospective_kv_blocks
        self._known_rate_per_worker_tokens_per_s = 0.0

    def add_client(self, client: WorkerClient) -> None:
        """Serve from ``client`` too (its capacity changes reach admission)."""
        client.on_change = self._changed
        self.clients.append(client)
        self._changed()

    def remove_client(self, client: WorkerClient) -> None:
        """Stop serving from ``client`` (no-op when it is not in the pool)."""
        if client in self.clients:
            self.clients.remove(client)
            client.on_change = None
            self._changed()

    def total_kv_blocks(self) -> int:
        """See :meth:`WorkerPool.total_kv_blocks`; when no worker serves, the prospective blocks of a coming one."""
        blocks = super().total_kv_blocks()
        return blocks if blocks > 0 else self._prospective_kv_blocks()

    def num_starting_workers(self) -> int:
        """Return the pool's workers that have not said Hello yet and are not draining (cold starts under way)."""
        return sum(1 for c in self.clients if c.hello is None and not c.draining)

    def drain_rate_tokens_per_s(self) -> float:
        """See :meth:`WorkerPool.drain_rate_tokens_per_s`, with every serving worker that has measured no rate
        yet (it just said Hello) and every worker still starting counted at the mean rate of the ones that have;
        with none that has, at the last such mean (kept through a scale to zero). 0.0 when never measured.

        Admission's predicted wait (work ahead ÷ this rate) then counts the capacity a scale-up is bringing, so a
        burst is not rejected early, nor the pressure level raised, for a wait the coming workers will cut. The
        cold start left is not subtracted: it is short next to queue deadlines, and the deadline itself still sheds
        a request that waits too long.
        """
        serving = self._serving_clients()
        rates = [rate for c in serving if c.capacity is not None
                 and (rate := c.capacity.busy_tokens_per_s) > 0]
        if rates:
            self._known_rate_per_worker_tokens_per_s = sum(rates) / len(rates)
        return self._known_rate_per_worker_tokens_per_s * (len(serving) + self.num_starting_workers())

    def starting_sequence_slots(self) -> int:
        """Return the sequence slots the workers still starting will bring, each the mean ``max_num_seqs`` of the
        serving ones (0 when none serves yet). Admission's slot wait counts them as free now, as
        :meth:`drain_rate_tokens_per_s` counts their rate: the cold start left is short next to queue deadlines."""
        starting = self.num_starting_workers()
        serving = [c.hello.max_num_seqs for c in self._serving_clients() if c.hello is not None]
        if not starting or not serving:
            return 0
        return starting * round(sum(serving) / len(serving))


@dataclass(eq=False)
class LocalWorker:
    """One ``sluice worker`` process this gateway spawned for a pool.

    Attributes:
        pool: the pool's name.
        index: its slot in the pool: the lowest number no other local worker of the pool holds (a worker that
            replaces a dead one takes its slot, so ``/status`` shows a restart as one more start of the slot).
        worker_id: ``local-<gateway pid>-<pool>-<n>``.
        socket_path: its Unix socket.
        device: the CUDA device it is pinned to (``CUDA_VISIBLE_DEVICES``), or None.
        client: the gateway's connection to it.
        spawned_at_s: monotonic time of the spawn.
        state: starting (no Hello yet), ready, draining.
        process: its process once spawned (``gateway.spawn``: forked by the fork server, or exec'd).
        stopping: the gateway asked it to exit (a scale-down or shutdown), so its exit is no failure.
        cold_start_s: spawn → Hello in seconds, once it said Hello.
    """

    pool: str
    index: int
    worker_id: str
    socket_path: str
    device: str | None
    client: WorkerClient
    spawned_at_s: float
    state: WorkerState = WorkerState.STARTING
    process: WorkerProcess | None = None
    stopping: bool = False
    cold_start_s: float | None = None


@dataclass(eq=False)
class PoolRuntime:
    """Everything one pool needs at run time.

    Attributes:
        config: the pool's config (``model`` and ``model_name`` filled in).
        pool: its workers (the admission controller's capacity view).
        admission: its tiered queues.
        capper: output caps at its pressure level.
        local: local workers by worker id.
        remote: remote workers (registry or ``--worker-address``) by name, with the monotonic time first seen.
        last_kv_blocks: KV blocks of the last worker of the pool that said Hello (the prospective capacity).
        spawn_failures: consecutive local workers that failed to start.
        spawn_blocked_until_s: no spawn before this monotonic time (backoff after failures).
        degraded_in: requests of each tier sent here instead of their own pool.
        starts_by_index: local workers started in each slot so far.
        service_rate_per_worker_tokens_per_s: the last known expected work tokens/s one worker drains (admission's
            measure), kept through a scale to zero; 0.0 = never measured.
        arrival_checked_at_s: when an arrival last looked at the offered load (``Fleet._on_arrival``), monotonic s.
    """

    config: PoolConfig
    pool: ElasticWorkerPool
    admission: AdmissionController
    capper: OutputCapper
    local: dict[str, LocalWorker] = field(default_factory=dict)
    remote: dict[str, tuple[WorkerClient, float]] = field(default_factory=dict)
    last_kv_blocks: int = 0
    spawn_failures: int = 0
    spawn_blocked_until_s: float = 0.0
    degraded_in: Counter[str] = field(default_factory=Counter)
    starts_by_index: Counter[int] = field(default_factory=Counter)
    service_rate_per_worker_tokens_per_s: float = 0.0
    arrival_checked_at_s: float = -math.inf

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def pressure(self) -> PressureMonitor:
        return self.admission.pressure

    def has_ready_worker(self) -> bool:
        return any(client.ready for client in self.pool.clients)


@dataclass(frozen=True)
class Route:
    """Where a request goes.

    Attributes:
        runtime: the pool that serves it.
        degraded: True when its tier's ``degrade_pool`` serves it instead of the pool of its model.
        requested: the pool of the model the request named.
    """

    runtime: PoolRuntime
    degraded: bool
    requested: PoolRuntime


def detect_gpu_ids() -> list[str]:
    """Return the CUDA device ids this machine has (``nvidia-smi -L``), [] when there is none or no driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _toml_string(value: str) -> str:
    """Return ``value`` as a TOML basic string (for ``SLUICE_*`` overrides, which are parsed as TOML values)."""
    return json.dumps(value)


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
        ConfigError: invalid pools or tiers.
    """

    def __init__(self, config: Config, metrics: Metrics, config_path: str | None = None, spawn_local: bool = True,
                 worker_addresses: Sequence[str] = (), limiter: RateLimiter | None = None,
                 default_capper: OutputCapper | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        validate_pool_config(config)
        self.config = config
        self.metrics = metrics
        self.config_path = config_path
        self.spawn_local = spawn_local
        self._clock = clock
        self._pool_configs = effective_pools(config)
        self._tiers = {tier.name: tier for tier in effective_tiers(config)}
        self.autoscaler = Autoscaler(self._pool_configs, config.autoscale, clock)
        self.meter = WorkerSecondsMeter(clock)
        self._owned_limiter = limiter is None
        self.limiter = limiter if limiter is not None else self._make_limiter(config)
        self.runtimes: dict[str, PoolRuntime] = {}
        for i, pool_config in enumerate(self._pool_configs):
            capper = default_capper if i == 0 and default_capper is not None else None
            self.runtimes[pool_config.name] = self._make_runtime(pool_config, capper)
        self.default = self.runtimes[self._pool_configs[0].name]
        for i, address in enumerate(worker_addresses):
            self._add_remote(self.default, f"remote-{i}", address)
        self.scale_events: Counter[tuple[str, str, str]] = Counter()  # (pool, action, reason)
        self.degraded: Counter[tuple[str, str]] = Counter()  # (tier, pool that answered)
        self._devices: dict[str, list[str]] = {}
        self._worker_numbers = iter(range(1, 1 << 62))
        self._spawner = WorkerSpawner(config.gateway.worker_start_method,
                                      preload_modules(pool.backend for pool in self._pool_configs))
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._registry_task: asyncio.Task | None = None
        self._watcher = None
        self._kick = asyncio.Event()
        self._closing = False
        self.cold_start_hist = Histogram("sluice_worker_cold_start_seconds", "Local worker spawn to Hello",
                                         ["pool"], buckets=_COLD_START_BUCKETS_S, registry=metrics.registry)
        metrics.registry.register(FleetCollector(self))

    # ----------------------------------------------------------------------------------------------- building

    @staticmethod
    def _make_limiter(config: Config) -> RateLimiter:
        if config.ratelimit.backend == "redis":
            from gateway.redis_ratelimit import RedisRateLimiter

            return RedisRateLimiter.from_config(config.ratelimit, config.registry.redis_url)
        return TokenBucketRateLimiter()

    def _make_runtime(self, pool_config: PoolConfig, capper: OutputCapper | None) -> PoolRuntime:
        holder: list[PoolRuntime] = []
        pool = ElasticWorkerPool(pool_config.name, lambda: self._prospective_kv_blocks(holder[0]))
        pool.prefill_queue_s = self.config.admission.worker_prefill_queue_s
        if self.config.admission.enabled:  # off: the workers see one tier label ("fifo") and prefill in order
            pool.tier_priorities = {tier.name: tier.priority for tier in effective_tiers(self.config)}
        if capper is None or capper.pressure_monitor is None:
            capper = OutputCapper(self.config, PressureMonitor(self.config.pressure, self._clock))
        admission = AdmissionController(self.config, pool, pressure=capper.pressure_monitor, limiter=self.limiter,
                                        clock=self._clock)
        pool.on_change = admission.on_capacity_changed
        runtime = PoolRuntime(pool_config, pool, admission, capper)
        admission.on_arrival = lambda: self._on_arrival(runtime)
        holder.append(runtime)
        return runtime

    def _prospective_kv_blocks(self, runtime: PoolRuntime) -> int:
        """KV blocks a coming worker of the pool will bring: 0 when none is coming."""
        coming = any(lw.state is WorkerState.STARTING for lw in runtime.local.values()) or (
            self._may_spawn(runtime) and len(self._active_local(runtime)) < self._max_local(runtime))
        return max(1, runtime.last_kv_blocks) if coming else 0

    def _max_local(self, runtime: PoolRuntime) -> int:
        """Most local workers of the pool: ``max_workers``, or ``min_workers`` with autoscaling off."""
        config = runtime.config
        return config.max_workers if self.config.autoscale.enabled else config.min_workers

    def _may_spawn(self, runtime: PoolRuntime) -> bool:
        return self.spawn_local and not self._closing and self._max_local(runtime) > 0

    # ----------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Connect to known workers, start the autoscale loop and the registry watcher (tasks owned here)."""
        for runtime in self.runtimes.values():
            for client, _ in runtime.remote.values():
                client.start()
        if self.spawn_local:
            if any(self._max_local(runtime) > 0 for runtime in self.runtimes.values()):
                self._spawner.warm_up()
            self._loop_task = asyncio.create_task(self._autoscale_loop(), name="autoscale-loop")
        if self.config.registry.redis_url:
            from gateway.registry import RegistryWatcher

            self._watcher = RegistryWatcher.from_config(self.config.registry)
            self._registry_task = asyncio.create_task(self._watch_registry(), name="registry-watcher")

    async def close(self) -> None:
        """Shed queued requests, stop the loops, stop every local worker (SIGTERM), close every connection."""
        self._closing = True
        self.start_draining()
        for task in (self._loop_task, self._registry_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.gather(*(self._stop_process(lw) for runtime in self.runtimes.values()
                               for lw in list(runtime.local.values())))
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for runtime in self.runtimes.values():
            runtime.pool.on_change = None
            await runtime.pool.close()
        if self._watcher is not None:
            await self._watcher.close()
        if self._owned_limiter and hasattr(self.limiter, "close"):
            await self.limiter.close()
        self._spawner.close()

    def start_draining(self) -> None:
        """Stop admitting in every pool: queued requests and new ones get 503 ``server_draining`` (SIGTERM)."""
        for runtime in self.runtimes.values():
            runtime.admission.start_draining()

    @property
    def draining(self) -> bool:
        """Whether the gateway stopped admitting."""
        return self.default.admission.draining

    def kick(self) -> None:
        """Run the autoscaler now instead of at the next interval."""
        self._kick.set()

    # ----------------------------------------------------------------------------------------------- routing

    def runtime_for_model(self, model: str) -> PoolRuntime:
        """Return the pool serving ``model``.

        Raises:
            SluiceError: ``model_not_found`` (404) naming the served models.
        """
        for runtime in self.runtimes.values():
            if runtime.config.model_name == model:
                return runtime
        served = ", ".join(f"'{m}'" for m in self.model_names())
        raise SluiceError(ErrorCode.MODEL_NOT_FOUND, f"The model '{model}' does not exist; this server serves "
                          f"{served} (see /v1/models)", param="model")

    def model_names(self) -> list[str]:
        """Return the served model ids, one per pool, in config order (duplicates once)."""
        return list(dict.fromkeys(runtime.config.model_name for runtime in self.runtimes.values()))

    def route(self, model: str, tier: TierConfig) -> Route:
        """Pick the pool of a request: its model's, or its tier's ``degrade_pool`` under the configured pressure.

        Raises:
            SluiceError: ``model_not_found`` for an unknown model.
        """
        requested = self.runtime_for_model(model)
        if tier.degrade_pool and tier.degrade_pool != requested.name and self.config.admission.enabled:
            threshold = PressureLevel[tier.degrade_at.upper()]
            if requested.pressure.level >= threshold:
                target = self.runtimes[tier.degrade_pool]
                target.degraded_in[tier.name] += 1
                self.degraded[(tier.name, target.name)] += 1
                return Route(target, True, requested)
        return Route(requested, False, requested)

    def check_cold_start(self, runtime: PoolRuntime, tier: str) -> None:
        """Before queueing for a pool with no ready worker: start one now; reject when it comes too late.

        The worker is started even for a request that is rejected, so that its retry (``Retry-After`` = the cold
        start left) finds it.

        Raises:
            SluiceError: 503 ``predicted_queue_timeout`` with ``Retry-After`` = the cold start left, when the
                expected cold start exceeds the tier's queue deadline at the current pressure (with
                ``admission.early_rejection``; without, the request waits and its deadline sheds it); 503
                ``no_worker_available`` when no worker can come at all.
        """
        if runtime.has_ready_worker():
            return
        if not runtime.local and not self._may_spawn(runtime):
            if runtime.pool.clients:
                return  # remote workers (re)connecting: admission decides
            raise SluiceError(ErrorCode.NO_WORKER, f"No worker of pool '{runtime.name}' is available.",
                              retry_after_s=self._clamp_retry_after(1.0))
        observation = self._observe(runtime, extra_queued=1)
        wait_s = self.autoscaler.predicted_wait_s(observation)
        if wait_s is None:
            raise SluiceError(ErrorCode.NO_WORKER, f"No worker of pool '{runtime.name}' is available.",
                              retry_after_s=self._clamp_retry_after(1.0))
        self._enact(self.autoscaler.tick([observation]))  # start one now, even for a request rejected below
        tier_config = self._tiers[tier]
        deadline_s = runtime.pressure.queue_timeout_s(tier, tier_config.queue_timeout_s)
        admission = self.config.admission
        if admission.enabled and admission.early_rejection and wait_s > deadline_s:
            raise SluiceError(
                ErrorCode.PREDICTED_QUEUE_TIMEOUT,
                f"No worker of pool '{runtime.name}' is ready and starting one takes about {wait_s:.1f} s, past the "
                f"'{tier}' tier's deadline ({deadline_s:g} s); retry when it is up.",
                retry_after_s=self._clamp_retry_after(wait_s))

    def _clamp_retry_after(self, seconds: float) -> int:
        return int(min(self.config.admission.max_retry_after_s, max(1, math.ceil(seconds))))

    # ----------------------------------------------------------------------------------------------- autoscaling

    def _on_arrival(self, runtime: PoolRuntime) -> None:
        """Wake the autoscaler now when the offered load, with the request that just arrived, needs more workers
        than the pool has ready or starting (rule 3 of ``gateway.autoscaler``: a burst begins), instead of at its
        next tick up to ``autoscale.interval_s`` later. Looks at most every :data:`ARRIVAL_CHECK_INTERVAL_S`."""
        now_s = self._clock()
        if (self._kick.is_set() or not self._may_spawn(runtime)
                or now_s - runtime.arrival_checked_at_s < ARRIVAL_CHECK_INTERVAL_S):
            return
        runtime.arrival_checked_at_s = now_s
        needed = self._demand_workers(runtime)
        if needed is None:
            return
        num_local = len(self._active_local(runtime))
        num_remote = sum(1 for client, _ in runtime.remote.values() if client.ready)
        if math.ceil(needed - 1e-9) > num_local + num_remote and num_local < self._max_local(runtime):
            self.kick()

    def autoscale_tick(self) -> None:
        """Run one autoscaler pass over every pool: observe it, decide, carry the decisions out.

        Each pool's admission is poked first (a dispatch pass, which observes the pressure level), so the level
        follows the pool at least once a tick: a pool with workers is observed at every capacity report anyway,
        but one scaled to zero has nobody reporting, and its level would stay where the last burst left it
        (critical, with its tighter deadlines) until the next burst, then take ``pressure.min_dwell_s`` per level
        to come down.
        """
        for runtime in self.runtimes.values():
            runtime.admission.on_capacity_changed()
        self._enact(self.autoscaler.tick([self._observe(r) for r in self.runtimes.values()]))

    async def _autoscale_loop(self) -> None:
        interval_s = self.config.autoscale.interval_s
        while True:
            try:
                self.autoscale_tick()
            except Exception:  # a bug must not stop autoscaling for good; it is logged with its traceback
                log.exception("autoscale_tick_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), interval_s)
            self._kick.clear()

    def _active_local(self, runtime: PoolRuntime) -> list[LocalWorker]:
        return [lw for lw in runtime.local.values() if lw.state is not WorkerState.DRAINING]

    def _observe(self, runtime: PoolRuntime, extra_queued: int = 0) -> PoolObservation:
        views = [WorkerView(lw.worker_id, lw.state, lw.spawned_at_s, lw.client.num_in_flight, True)
                 for lw in runtime.local.values()]
        for name, (client, seen_s) in runtime.remote.items():
            state = WorkerState.READY if client.ready else WorkerState.STARTING
            views.append(WorkerView(name, state, seen_s, client.num_in_flight, False))
        snapshot = runtime.admission.snapshot()
        num_queued = sum(stats["queue_depth"] for stats in snapshot["tiers"].values()) + extra_queued
        lowest = min(snapshot["tiers"], key=lambda name: snapshot["tiers"][name]["priority"])
        return PoolObservation(runtime.name, views, runtime.admission.predicted_wait_s(lowest), num_queued,
                               runtime.pressure.level, self._utilisation(runtime), self._demand_workers(runtime))

    def _demand_workers(self, runtime: PoolRuntime) -> float | None:
        """Workers the pool's offered load needs (see ``gateway.autoscaler`` rule 3); None without a known rate.

        The work that arrived over a window of ``w`` seconds may be served within the window plus the pool's
        ``target_queue_wait_s`` T (requests may wait that long in the queue), so it needs
        ``work ÷ (rate × target_utilisation × (w + T))`` workers. Two windows, the larger answer wins:
        ``autoscale.demand_window_s`` and a tenth of it. The short window sees a burst begin, the long one holds
        workers through the short gaps inside a burst (Knative's autoscaler: a panic window of 10% of the stable
        window, and no scale-down while it is high). Over a long window the answer tends to load ÷ rate; a burst
        whose work the ready workers clear within T is absorbed by the queue instead of starting workers that would
        sit idle once it is served (on the autoscaling bench, a few requests arriving together in 0.4 s used to
        start all 4 workers for the next 5–9 s).

        The per-worker service rate is remembered, so a pool scaled to zero sizes its next burst with it.
        """
        autoscale = self.config.autoscale
        if autoscale.demand_window_s <= 0:
            return None
        rate = runtime.admission.service_rate_per_worker_tokens_per_s()
        if rate is not None and rate > 0:
            runtime.service_rate_per_worker_tokens_per_s = rate
        rate = runtime.service_rate_per_worker_tokens_per_s
        if rate <= 0:
            return None
        wait_s = runtime.config.target_queue_wait_s
        needed = 0.0
        for window_s in (autoscale.demand_window_s, autoscale.demand_window_s * PANIC_WINDOW_FRACTION):
            work_tokens = runtime.admission.arrival_rate_tokens_per_s(window_s) * window_s
            needed = max(needed, work_tokens / (rate * autoscale.target_utilisation * (window_s + wait_s)))
        return needed

    @staticmethod
    def _utilisation(runtime: PoolRuntime) -> float:
        """Return in-flight demand ÷ capacity of the pool's ready workers: KV or sequence slots, the fuller."""
        ready = [c for c in runtime.pool.clients if c.ready and c.hello is not None]
        if not ready:
            return 0.0
        slots = sum(c.hello.max_num_seqs for c in ready)
        seqs = sum(max(c.num_reserved, c.num_in_flight) for c in ready) / slots if slots else 0.0
        return max(runtime.pool.kv_used_fraction(), seqs)

    def _enact(self, decisions: Iterable[ScaleDecision]) -> None:
        for decision in decisions:
            runtime = self.runtimes[decision.pool]
            if decision.action is ScaleAction.UP:
                started = sum(1 for _ in range(decision.num_workers) if self._spawn(runtime))
                if started == 0:
                    continue
            else:
                lw = runtime.local.get(decision.worker_id)
                if lw is None or lw.state is not WorkerState.READY:
                    continue
                self._own(self._drain_and_stop(runtime, lw), f"drain-{lw.worker_id}")
            self.scale_events[(decision.pool, decision.action.value, decision.reason.value)] += 1
            log.info("scale_" + decision.action.value, pool=decision.pool, reason=decision.reason.value,
                     num_workers=decision.num_workers, worker_id=decision.worker_id or None, detail=decision.detail)

    def _own(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ----------------------------------------------------------------------------------------------- local workers

    def _pool_devices(self, runtime: PoolRuntime) -> list[str]:
        if runtime.name not in self._devices:
            config = runtime.config
            devices = list(config.devices)
            if not devices and config.backend == "cuda":
                devices = detect_gpu_ids()
            self._devices[runtime.name] = devices
        return self._devices[runtime.name]

    def _spawn(self, runtime: PoolRuntime) -> bool:
        """Start one local worker for the pool; False when none may start now (no device free, backoff)."""
        now_s = self._clock()
        if self._closing or now_s < runtime.spawn_blocked_until_s:
            return False
        device = None
        devices = self._pool_devices(runtime)
        if devices:
            used = {lw.device for lw in runtime.local.values()}
            free = [d for d in devices if d not in used]
            if not free:
                log.warning("scale_up_no_free_device", pool=runtime.name, devices=devices)
                return False
            device = free[0]
        number = next(self._worker_numbers)
        safe_pool = _UNSAFE_PATH_CHARS.sub("_", runtime.name)
        worker_id = f"local-{os.getpid()}-{safe_pool}-{number}"
        socket_path = f"/tmp/sluice-{os.getpid()}-{safe_pool}-{number}.sock"
        taken = {lw.index for lw in runtime.local.values()}
        index = next(i for i in range(len(taken) + 1) if i not in taken)
        # the label of logs and metrics: stable per slot (a replacement keeps it), as before pools existed
        name = f"local-{index}" if not self.config.pools else f"{safe_pool}-{index}"
        client = WorkerClient(f"unix:{socket_path}", name, self.metrics.observe_capacity,
                              WorkerPool.make_breaker(self.config.breaker), FIRST_CONNECT_INTERVAL_S)
        lw = LocalWorker(runtime.name, index, worker_id, socket_path, device, client, now_s)
        runtime.local[worker_id] = lw
        runtime.starts_by_index[index] += 1
        self.meter.started(runtime.name, worker_id)
        self._own(self._run_local(runtime, lw), f"local-worker-{worker_id}")
        return True

    def worker_env(self, pool: PoolConfig, device: str | None) -> dict[str, str]:
        """Return the environment of a local worker of ``pool`` (the gateway's, plus the pool's settings)."""
        env = dict(os.environ)
        env["SLUICE_WORKER__BACKEND"] = _toml_string(pool.backend)
        env["SLUICE_MODEL__NAME"] = _toml_string(pool.model_name)
        if pool.model:
            env["SLUICE_MODEL__PATH"] = _toml_string(pool.model)
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        env.update(pool.env)
        return env

    def worker_args(self, lw: LocalWorker) -> list[str]:
        """Return the arguments of a local worker (after ``sluice worker``)."""
        argv = ["--listen", f"unix:{lw.socket_path}", "--worker-id", lw.worker_id]
        if self.config_path:
            argv += ["--config", self.config_path]
        return argv

    async def _run_local(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
        """Spawn the worker, wait for its Hello (the cold start), then supervise it until it exits."""
        try:
            try:
                lw.process = await self._spawner.spawn(self.worker_args(lw),
                                                       self.worker_env(runtime.config, lw.device), lw.worker_id)
            except OSError as exc:
                log.error("local_worker_spawn_failed", pool=runtime.name, worker_id=lw.worker_id, error=str(exc))
                self._spawn_failed(runtime)
                return
            log.info("local_worker_spawned", pool=runtime.name, worker_id=lw.worker_id, pid=lw.process.pid,
                     device=lw.device, start_method=self._spawner.method)
            lw.client.start()
            runtime.pool.add_client(lw.client)
            if await self._wait_hello(lw):
                self._on_ready(runtime, lw)
            returncode = await lw.process.wait()
            if not lw.stopping:
                log.error("local_worker_exited", pool=runtime.name, worker_id=lw.worker_id, returncode=returncode,
                          state=lw.state.value)
                if lw.cold_start_s is None:
                    self._spawn_failed(runtime)
        finally:
            if lw.process is not None and lw.process.returncode is None:
                lw.process.kill()
                await lw.process.wait()
            self._forget_local(runtime, lw)
            await lw.client.close()
            self.kick()

    async def _wait_hello(self, lw: LocalWorker) -> bool:
        """Return True once the worker said Hello; False when it exited or timed out first (then it is killed)."""
        timeout_s = self.config.gateway.worker_start_timeout_s
        hello = asyncio.ensure_future(lw.client.wait_ready(timeout_s))
        exited = asyncio.ensure_future(lw.process.wait())
        try:
            done, _ = await asyncio.wait({hello, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (hello, exited):
                if not future.done():
                    future.cancel()
        if hello not in done:
            return False
        if not hello.result():
            log.error("local_worker_start_timeout", worker_id=lw.worker_id, timeout_s=timeout_s)
            lw.process.kill()
            return False
        return True

    def _on_ready(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
        lw.cold_start_s = self._clock() - lw.spawned_at_s
        if lw.state is WorkerState.STARTING:
            lw.state = WorkerState.READY
        runtime.spawn_failures = 0
        if lw.client.hello is not None:
            runtime.last_kv_blocks = lw.client.hello.num_kv_blocks
        self.autoscaler.record_cold_start(runtime.name, lw.cold_start_s)
        self.cold_start_hist.labels(runtime.name).observe(lw.cold_start_s)
        log.info("local_worker_ready", pool=runtime.name, worker_id=lw.worker_id,
                 cold_start_s=round(lw.cold_start_s, 3))
        runtime.admission.on_capacity_changed()

    def _spawn_failed(self, runtime: PoolRuntime) -> None:
        runtime.spawn_failures += 1
        backoff_s = min(MAX_SPAWN_BACKOFF_S,
                        self.config.gateway.worker_restart_backoff_s * 2 ** (runtime.spawn_failures - 1))
        runtime.spawn_blocked_until_s = self._clock() + backoff_s
        log.warning("local_worker_spawn_backoff", pool=runtime.name, failures=runtime.spawn_failures,
                    backoff_s=backoff_s)

    def _forget_local(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
        if runtime.local.pop(lw.worker_id, None) is None:
            return
        runtime.pool.remove_client(lw.client)
        self.meter.stopped(runtime.name, lw.worker_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lw.socket_path)

    async def _drain_and_stop(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
        """Take no new request on the worker, let the running ones end, then stop its process.

        The gateway stops routing to it first; ``Drain`` follows once every request admitted to it has been sent
        (so none is refused by the draining worker), and SIGTERM once every one of them has ended.
        """
        lw.state = WorkerState.DRAINING
        client = lw.client
        client.mark_draining()
        log.info("local_worker_draining", pool=runtime.name, worker_id=lw.worker_id, in_flight=client.num_in_flight,
                 reserved=client.num_reserved)
        deadline_s = self._clock() + DRAIN_DISPATCH_WAIT_S
        while client.num_reserved > client.num_in_flight and self._clock() < deadline_s:
            await asyncio.sleep(DRAIN_POLL_S)
        client.send_drain()
        while client.num_reserved > 0 or client.num_in_flight > 0:
            await asyncio.sleep(DRAIN_POLL_S)
        await self._stop_process(lw)
        log.info("local_worker_stopped", pool=runtime.name, worker_id=lw.worker_id)

    async def _stop_process(self, lw: LocalWorker) -> None:
        lw.stopping = True
        process = lw.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            log.warning("local_worker_kill", worker_id=lw.worker_id, pid=process.pid)
            process.kill()
            await process.wait()

    # ----------------------------------------------------------------------------------------------- remote workers

    def _add_remote(self, runtime: PoolRuntime, name: str, address: str) -> WorkerClient:
        client = WorkerClient(address, name, self.metrics.observe_capacity,
                              WorkerPool.make_breaker(self.config.breaker))
        runtime.remote[name] = (client, self._clock())
        runtime.pool.add_client(client)
        return client

    async def _watch_registry(self) -> None:
        from gateway.registry import RegistryEventKind

        async for event in self._watcher.events():
            worker = event.worker
            name = f"registry-{worker.worker_id}"
            if event.kind is RegistryEventKind.JOIN:
                runtime = next((r for r in self.runtimes.values() if r.config.model_name == worker.hello.model_id),
                               None)
                if runtime is None:
                    log.warning("registry_worker_unknown_model", worker_id=worker.worker_id,
                                model=worker.hello.model_id, served=self.model_names())
                    continue
                self._add_remote(runtime, name, worker.address).start()
                runtime.last_kv_blocks = runtime.last_kv_blocks or worker.hello.num_kv_blocks
            else:
                for runtime in self.runtimes.values():
                    entry = runtime.remote.pop(name, None)
                    if entry is not None:
                        runtime.pool.remove_client(entry[0])
                        await entry[0].close()  # requests not yet streaming there are retried elsewhere
            self.kick()

    # ----------------------------------------------------------------------------------------------- reports

    def worker_status(self) -> list[dict]:
        """Return every worker of every pool (``WorkerPool.status`` entries with ``pool`` and ``state``)."""
        out: list[dict] = []
        for runtime in self.runtimes.values():
            states = {lw.client.name: lw.state.value for lw in runtime.local.values()}
            for entry in runtime.pool.status():
                name = entry["name"]
                entry["pool"] = runtime.name
                entry["local"] = name in states
                entry["state"] = states.get(name, "ready" if entry["ready"] else "starting")
                out.append(entry)
        return out

    def local_worker_status(self) -> list[dict]:
        """Return every local worker process, by pool then slot (``/status`` ``local_workers``)."""
        out: list[dict] = []
        for runtime in self.runtimes.values():
            for lw in sorted(runtime.local.values(), key=lambda lw: lw.index):
                out.append({"index": lw.index, "pid": lw.process.pid if lw.process else None,
                            "starts": runtime.starts_by_index[lw.index], "address": lw.client.address,
                            "pool": runtime.name, "worker_id": lw.worker_id, "state": lw.state.value})
        return out

    def is_ready(self) -> bool:
        """Return whether requests can be served: a worker is ready, or a pool scales from zero (min_workers = 0)
        and can start one (requests then wait through its cold start)."""
        return any(runtime.has_ready_worker() or (runtime.config.min_workers == 0 and self._may_spawn(runtime))
                   for runtime in self.runtimes.values())

    def admission_snapshot(self) -> dict[str, Any]:
        """Return the pools' admission snapshots merged per tier (counts summed, the highest pressure level)."""
        snapshots = {name: runtime.admission.snapshot() for name, runtime in self.runtimes.items()}
        merged = snapshots[self.default.name]
        if len(snapshots) == 1:
            return merged
        merged = json.loads(json.dumps(merged))
        for name, snapshot in snapshots.items():
            if name == self.default.name:
                continue
            merged["drain_rate_tokens_per_s"] += snapshot["drain_rate_tokens_per_s"]
            if PressureLevel[snapshot["pressure"]["level"].upper()] > PressureLevel[
                    merged["pressure"]["level"].upper()]:
                merged["pressure"] = snapshot["pressure"]
            for tier, stats in snapshot["tiers"].items():
                into = merged["tiers"][tier]
                for key in ("queue_depth", "in_flight", "in_flight_kv_blocks", "admitted", "cancelled"):
                    into[key] += stats[key]
                into["oldest_wait_s"] = max(into["oldest_wait_s"], stats["oldest_wait_s"])
                for reason, count in stats["rejected"].items():
                    into["rejected"][reason] = into["rejected"].get(reason, 0) + count
        merged["pools"] = snapshots
        return merged

    def snapshot(self) -> dict[str, Any]:
        """Return pools (workers by state, worker-seconds, cost, cold starts, degraded requests), scale events,
        and the autoscaler's recent decisions (for ``/status``)."""
        scaler = self.autoscaler.snapshot()
        pools: dict[str, Any] = {}
        now_s = self._clock()
        for name, runtime in self.runtimes.items():
            states = Counter(lw.state.value for lw in runtime.local.values())
            for client, _ in runtime.remote.values():
                states["ready" if client.ready else "starting"] += 1
            worker_seconds = self.meter.worker_seconds(name)
            pools[name] = {
                "model": runtime.config.model_name,
                "backend": runtime.config.backend,
                "min_workers": runtime.config.min_workers,
                "max_workers": runtime.config.max_workers,
                "workers": {state.value: states.get(state.value, 0) for state in WorkerState},
                "local_workers": [
                    {"worker_id": lw.worker_id, "state": lw.state.value, "device": lw.device,
                     "pid": lw.process.pid if lw.process else None, "age_s": round(now_s - lw.spawned_at_s, 3),
                     "cold_start_s": None if lw.cold_start_s is None else round(lw.cold_start_s, 3),
                     "in_flight": lw.client.num_in_flight}
                    for lw in runtime.local.values()
                ],
                "remote_workers": sorted(runtime.remote),
                "worker_seconds": round(worker_seconds, 3),
                "cost": round(worker_seconds * runtime.config.cost_per_worker_s, 3),
                "cold_start_s": scaler["pools"][name]["cold_start_s"],
                "num_cold_starts": scaler["pools"][name]["num_cold_starts"],
                "pressure": runtime.pressure.level.label,
                "degraded_requests_in": dict(runtime.degraded_in),
            }
        return {
            "autoscale_enabled": self.config.autoscale.enabled,
            "pools": pools,
            "scale_events": [
                {"pool": pool, "action": action, "reason": reason, "count": count}
                for (pool, action, reason), count in sorted(self.scale_events.items())
            ],
            "recent_decisions": scaler["events"],
            "degraded_requests": {
                tier: sum(count for (t, _), count in self.degraded.items() if t == tier)
                for tier in sorted({t for t, _ in self.degraded})
            },
        }


class FleetCollector:
    """Prometheus collector of the fleet's state, read at scrape time.

    ``sluice_pool_workers{pool,state}``, ``sluice_pool_worker_seconds_total{pool}``, ``sluice_pool_cost_total{pool}``,
    ``sluice_pool_cold_start_estimate_seconds{pool}``, ``sluice_scale_events_total{pool,action,reason}``,
    ``sluice_degraded_requests_total{tier,pool}``. (``sluice_worker_cold_start_seconds{pool}`` is a histogram
    observed live.)
    """

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterable[Metric]:
        """Yield the metric families (called by the registry on every scrape)."""
        snapshot = self._fleet.snapshot()
        workers = GaugeMetricFamily("sluice_pool_workers", "Workers per pool and state", labels=["pool", "state"])
        seconds = CounterMetricFamily("sluice_pool_worker_seconds", "Seconds local workers of the pool existed",
                                      labels=["pool"])
        cost = CounterMetricFamily("sluice_pool_cost", "Worker-seconds × the pool's cost_per_worker_s",
                                   labels=["pool"])
        cold = GaugeMetricFamily("sluice_pool_cold_start_estimate_seconds", "Expected cold start of the pool",
                                 labels=["pool"])
        for name, pool in snapshot["pools"].items():
            for state, count in pool["workers"].items():
                workers.add_metric([name, state], count)
            seconds.add_metric([name], pool["worker_seconds"])
            cost.add_metric([name], pool["cost"])
            cold.add_metric([name], pool["cold_start_s"])
        events = CounterMetricFamily("sluice_scale_events", "Autoscaler actions carried out",
                                     labels=["pool", "action", "reason"])
        for event in snapshot["scale_events"]:
            events.add_metric([event["pool"], event["action"], event["reason"]], event["count"])
        degraded = CounterMetricFamily("sluice_degraded_requests", "Requests served by their tier's degrade pool",
                                       labels=["tier", "pool"])
        for (tier, pool), count in sorted(self._fleet.degraded.items()):
            degraded.add_metric([tier, pool], count)
        yield from (workers, seconds, cost, cold, events, degraded)


__all__ = ["ElasticWorkerPool", "Fleet", "FleetCollector", "LocalWorker", "PoolRuntime", "Route", "ScaleReason",
           "detect_gpu_ids"]
