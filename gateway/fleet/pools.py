"""A pool's run-time state: its elastic worker pool, admission and caps, its local and remote workers, and where
a request is routed (:class:`Route`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.admission.caps import OutputCapper
from gateway.admission.controller import AdmissionController
from gateway.admission.pressure import PressureMonitor
from gateway.fleet.autoscaler import WorkerState
from gateway.fleet.spawn import WorkerProcess
from gateway.workers.client import WorkerClient
from gateway.workers.pool import WorkerPool
from gateway.workers.reservation import Reservation
from shared.config import PoolConfig


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
        client.on_change = self._client_changed
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
        process: its process once spawned (``gateway.fleet.spawn``: forked by the fork server, or exec'd).
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
        last_start_failure: why the last local worker that failed to start did (None once one starts).
        config_error: why a local worker of the pool stopped on a configuration error before it was ready (the
            worker's own one-line reason); once set, no local worker of the pool is started again in this run.
        degraded_in: requests of each tier sent here instead of their own pool.
        starts_by_index: local workers started in each slot so far.
        service_rate_per_worker_tokens_per_s: the last known expected work tokens/s one worker drains (admission's
            measure), kept through a scale to zero; 0.0 = never measured.
        arrival_checked_at_s: when an arrival last looked at the offered load (``ScalingLoop.on_arrival``), monotonic s.
        watches_registry: workers may join the pool from the Redis worker registry (``[registry] redis_url``).
    """

    config: PoolConfig
    pool: ElasticWorkerPool
    admission: AdmissionController[Reservation]
    capper: OutputCapper
    local: dict[str, LocalWorker] = field(default_factory=dict)
    remote: dict[str, tuple[WorkerClient, float]] = field(default_factory=dict)
    last_kv_blocks: int = 0
    spawn_failures: int = 0
    spawn_blocked_until_s: float = 0.0
    last_start_failure: str | None = None
    config_error: str | None = None
    degraded_in: Counter[str] = field(default_factory=Counter)
    starts_by_index: Counter[int] = field(default_factory=Counter)
    service_rate_per_worker_tokens_per_s: float = 0.0
    arrival_checked_at_s: float = -math.inf
    watches_registry: bool = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def pressure(self) -> PressureMonitor:
        return self.admission.pressure

    def has_ready_worker(self) -> bool:
        return any(client.ready for client in self.pool.clients)

    def has_serving_worker(self) -> bool:
        """Return whether a worker can take a request now: ready, and its breaker not open."""
        return self.pool.num_serving_workers() > 0

    def not_serving_reason(self) -> str:
        """Return why no worker of the pool takes a request now (``/readyz``'s words): each worker's
        ``not_ready_reason``, the last local start failure, the configuration error that stopped its local
        workers, the local workers still loading."""
        reasons = [reason for client in self.pool.clients if (reason := client.not_ready_reason()) is not None]
        if self.last_start_failure is not None:
            reasons.append(f"last local worker start failed: {self.last_start_failure}")
        if self.config_error is not None:
            reasons.append(f"its local workers are not started: {self.config_error}")
        reasons += [f"local worker {lw.client.name} starting (loading the model, not listening yet)"
                    for lw in self.local.values() if lw.client not in self.pool.clients]
        return "; ".join(reasons) if reasons else self.no_worker_words()

    def no_worker_words(self) -> str:
        """Why the pool has no worker at all: none configured, or (with a registry) none registered yet."""
        if self.watches_registry:
            return "no worker has registered in the worker registry ([registry] redis_url) yet"
        return "no worker configured"


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
