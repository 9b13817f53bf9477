"""The autoscale loop: every ``autoscale.interval_s`` (and at once when an arrival needs more workers, or a request
finds no worker), observe each pool, let :class:`~gateway.fleet.autoscaler.Autoscaler` decide, and carry the
decisions out through :class:`~gateway.fleet.local_processes.LocalProcesses` (spawn, or drain and stop).

A pool that may start a worker (or has one starting) announces the KV capacity of its last worker (one block before
any) to admission, so a request that finds no worker waits in its tier queue through the cold start, with its
deadline; :meth:`ScalingLoop.check_cold_start` rejects it at once with 503 and ``Retry-After`` (the cold start left)
when the measured cold start cannot make its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterable

import structlog

from gateway.aio import wait_event
from gateway.fleet.autoscaler import Autoscaler, PoolObservation, ScaleAction, ScaleDecision, WorkerState, WorkerView
from gateway.fleet.local_processes import LocalProcesses
from gateway.fleet.pools import LocalWorker, PoolRuntime
from shared.config import Config, TierConfig
from shared.errors import ErrorCode, SluiceError

log = structlog.get_logger("sluice.gateway")

# Share of ``autoscale.demand_window_s`` over which a burst's arrival rate is also measured (Knative's panic window).
PANIC_WINDOW_FRACTION = 0.1
# Least seconds between two looks at a pool's offered load on arrival (:meth:`ScalingLoop.on_arrival`): a burst of
# hundreds of requests a second costs at most this many demand sums, not one per request.
ARRIVAL_CHECK_INTERVAL_S = 0.05


class ScalingLoop:
    """Size every pool to its load: the autoscale loop, the arrival kick, and the cold-start check.

    Args:
        config: the whole config (``autoscale``, ``admission``).
        runtimes: the pools by name (owned by the fleet).
        tiers: the tiers by name.
        autoscaler: the scaling policy.
        local: the local worker processes.
        spawn_local: whether local workers may be started at all.
        clock: monotonic seconds.
    """

    def __init__(self, config: Config, runtimes: dict[str, PoolRuntime], tiers: dict[str, TierConfig],
                 autoscaler: Autoscaler, local: LocalProcesses, spawn_local: bool,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.runtimes = runtimes
        self._tiers = tiers
        self.autoscaler = autoscaler
        self._local = local
        self.spawn_local = spawn_local
        self._clock = clock
        self.kick_event = asyncio.Event()
        self.scale_events: Counter[tuple[str, str, str]] = Counter()  # (pool, action, reason)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the autoscale loop (a task owned here)."""
        self._task = asyncio.create_task(self._autoscale_loop(), name="autoscale-loop")

    async def stop(self) -> None:
        """Cancel the autoscale loop and wait for it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def prospective_kv_blocks(self, runtime: PoolRuntime) -> int:
        """KV blocks a coming worker of the pool will bring: 0 when none is coming."""
        coming = any(lw.state is WorkerState.STARTING for lw in runtime.local.values()) or (
            self.may_spawn(runtime) and len(self.active_local(runtime)) < self.max_local(runtime))
        return max(1, runtime.last_kv_blocks) if coming else 0

    def max_local(self, runtime: PoolRuntime) -> int:
        """Most local workers of the pool: ``max_workers``, or ``min_workers`` with autoscaling off."""
        config = runtime.config
        return config.max_workers if self.config.autoscale.enabled else config.min_workers

    def may_spawn(self, runtime: PoolRuntime) -> bool:
        """Return whether the pool may start local workers (not after one stopped on a configuration error)."""
        return (self.spawn_local and not self._local.closing and self.max_local(runtime) > 0
                and runtime.config_error is None)

    def max_sequence_slots(self, runtime: PoolRuntime) -> int | None:
        """Return the most sequences the pool can run at once when all its workers are up: the slots
        (``max_num_seqs``, an upstream's concurrency) of every worker that said Hello, plus, while local workers may
        be started, the largest worker's for each local worker it may still start; None before any worker said
        Hello (not known yet)."""
        slots = [client.hello.max_num_seqs for client in runtime.pool.clients if client.hello is not None]
        if not slots:
            return None
        total = sum(slots)
        if self.may_spawn(runtime):
            started = sum(1 for lw in runtime.local.values() if lw.client.hello is not None)
            total += max(0, self.max_local(runtime) - started) * max(slots)
        return total

    def kick(self) -> None:
        """Run the autoscaler now instead of at the next interval."""
        self.kick_event.set()

    def shed_if_unservable(self, runtime: PoolRuntime) -> None:
        """Turn the pool's queued requests away with 503 ``no_worker_available`` naming its configuration error when
        none can be served any more: its local workers stopped on that error (not restarted) and it has no other
        worker or upstream. They waited for a cold start (a pool scaled to zero) that will not come; without this
        they would wait out their deadlines and be told the server is overloaded."""
        if runtime.config_error is None or runtime.local or runtime.pool.clients:
            return
        runtime.admission.shed_queued(ErrorCode.NO_WORKER, _no_local_worker_message(runtime),
                                      self._clamp_retry_after(1.0))

    def check_cold_start(self, runtime: PoolRuntime, tier: str, count_rejection: bool = True) -> None:
        """Before queueing for a pool with no ready worker: start one now; reject when it comes too late.

        The worker is started even for a request that is rejected, so that its retry (``Retry-After`` = the cold
        start left) finds it.

        Raises:
            SluiceError: 503 ``predicted_queue_timeout`` with ``Retry-After`` = the cold start left, when the
                expected cold start exceeds the tier's queue deadline at the current pressure (with
                ``admission.early_rejection`` and a known cold start: measured, or ``autoscale.initial_cold_start_s``
                set; otherwise the request waits and its deadline sheds it); 503 ``no_worker_available`` when no
                worker can come at all, naming why each of the pool's workers or upstreams takes no request
                (:meth:`PoolRuntime.not_serving_reason`). Each is counted in the tier's rejections (``/status``,
                ``sluice_rejected_total``), as admission counts its own, unless ``count_rejection`` is False (the
                caller counts it once it knows whether a client got the 503: ``Ticket.counts_shed``).
        """
        if runtime.has_serving_worker():
            return
        if not runtime.local and not self.may_spawn(runtime):
            if runtime.pool.clients:
                # remote workers or upstreams, none serving (down, reconnecting, breaker open, not serving the
                # model): admission has no capacity to queue on and would turn the request away without saying why
                raise self._rejected(runtime, tier, count_rejection, SluiceError(
                    ErrorCode.NO_WORKER, f"No worker of pool '{runtime.name}' is available: "
                    f"{runtime.not_serving_reason()}.",
                    retry_after_s=self._clamp_retry_after(runtime.pool.no_worker_retry_after_s())))
            raise self._rejected(runtime, tier, count_rejection, SluiceError(
                ErrorCode.NO_WORKER, _no_local_worker_message(runtime), retry_after_s=self._clamp_retry_after(1.0)))
        if runtime.has_ready_worker():
            return  # its breaker is open: admission decides
        observation = self._observe(runtime, extra_queued=1)
        wait_s = self.autoscaler.predicted_wait_s(observation)
        if wait_s is None:
            raise self._rejected(runtime, tier, count_rejection, SluiceError(
                ErrorCode.NO_WORKER, f"No worker of pool '{runtime.name}' is available.",
                retry_after_s=self._clamp_retry_after(1.0)))
        self._enact(self.autoscaler.tick([observation]))  # start one now, even for a request rejected below
        tier_config = self._tiers[tier]
        deadline_s = runtime.pressure.queue_timeout_s(tier, tier_config.queue_timeout_s)
        admission = self.config.admission
        if (admission.enabled and admission.early_rejection and wait_s > deadline_s
                and self.autoscaler.cold_start_known(runtime.name)):
            raise self._rejected(runtime, tier, count_rejection, SluiceError(
                ErrorCode.PREDICTED_QUEUE_TIMEOUT,
                f"No worker of pool '{runtime.name}' is ready and starting one takes about {wait_s:.1f} s, past the "
                f"'{tier}' tier's deadline ({deadline_s:g} s); retry when it is up.",
                retry_after_s=self._clamp_retry_after(wait_s)))

    @staticmethod
    def _rejected(runtime: PoolRuntime, tier: str, count_rejection: bool, error: SluiceError) -> SluiceError:
        """Count ``error`` in the tier's rejections when ``count_rejection`` is set, and return it."""
        if count_rejection:
            runtime.admission.shedder.count_rejected(tier, error.code)
        return error

    def _clamp_retry_after(self, seconds: float) -> int:
        return int(min(self.config.admission.max_retry_after_s, max(1, math.ceil(seconds))))

    def on_arrival(self, runtime: PoolRuntime) -> None:
        """Wake the autoscaler now when the offered load, with the request that just arrived, needs more workers
        than the pool has ready or starting (rule 3 of ``gateway.fleet.autoscaler``: a burst begins), instead of at its
        next tick up to ``autoscale.interval_s`` later. Looks at most every :data:`ARRIVAL_CHECK_INTERVAL_S`, and not
        at all while the pool has all the local workers it may have (the demand sum walks the arrivals of the last
        seconds: about 1% of the gateway's CPU at 1300 requests/s when it ran for nothing)."""
        now_s = self._clock()
        if (self.kick_event.is_set() or not self.may_spawn(runtime)
                or now_s - runtime.arrival_checked_at_s < ARRIVAL_CHECK_INTERVAL_S):
            return
        runtime.arrival_checked_at_s = now_s
        num_local = len(self.active_local(runtime))
        if num_local >= self.max_local(runtime):
            return
        needed = self.demand_workers(runtime)
        if needed is None:
            return
        num_remote = sum(1 for client, _ in runtime.remote.values() if client.ready)
        if math.ceil(needed - 1e-9) > num_local + num_remote:
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
            await wait_event(self.kick_event, interval_s)
            self.kick_event.clear()

    def active_local(self, runtime: PoolRuntime) -> list[LocalWorker]:
        return [lw for lw in runtime.local.values() if lw.state is not WorkerState.DRAINING]

    def _observe(self, runtime: PoolRuntime, extra_queued: int = 0) -> PoolObservation:
        views = [WorkerView(lw.worker_id, lw.state, lw.spawned_at_s, lw.client.num_in_flight, True)
                 for lw in runtime.local.values()]
        for name, (client, seen_s) in runtime.remote.items():
            state = WorkerState.READY if client.ready else WorkerState.STARTING
            views.append(WorkerView(name, state, seen_s, client.num_in_flight, False))
        num_queued = runtime.admission.num_queued() + extra_queued
        predicted_wait_s = runtime.admission.predicted_wait_s(runtime.admission.lowest_tier)
        return PoolObservation(runtime.name, views, predicted_wait_s, num_queued,
                               runtime.pressure.level, self._utilisation(runtime), self.demand_workers(runtime))

    def demand_workers(self, runtime: PoolRuntime) -> float | None:
        """Workers the pool's offered load needs (see ``gateway.fleet.autoscaler`` rule 3); None without a known rate.

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
        rate = runtime.admission.rates.service_rate_per_worker_tokens_per_s()
        if rate is not None and rate > 0:
            runtime.service_rate_per_worker_tokens_per_s = rate
        rate = runtime.service_rate_per_worker_tokens_per_s
        if rate <= 0:
            return None
        wait_s = runtime.config.target_queue_wait_s
        needed = 0.0
        for window_s in (autoscale.demand_window_s, autoscale.demand_window_s * PANIC_WINDOW_FRACTION):
            work_tokens = runtime.admission.rates.arrival_rate_tokens_per_s(window_s) * window_s
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
                started = sum(1 for _ in range(decision.num_workers) if self._local.spawn(runtime))
                if started == 0:
                    continue
            else:
                lw = runtime.local.get(decision.worker_id)
                if lw is None or lw.state is not WorkerState.READY:
                    continue
                self._local.own(self._local.drain_and_stop(runtime, lw), f"drain-{lw.worker_id}")
            self.scale_events[(decision.pool, decision.action.value, decision.reason.value)] += 1
            log.info("scale_" + decision.action.value, pool=decision.pool, reason=decision.reason.value,
                     num_workers=decision.num_workers, worker_id=decision.worker_id or None, detail=decision.detail)


def _no_local_worker_message(runtime: PoolRuntime) -> str:
    """The 503 ``no_worker_available`` message of a pool with no worker and none it can start."""
    why = f" Its local workers are not started: {runtime.config_error}" if runtime.config_error else ""
    return f"No worker of pool '{runtime.name}' is available.{why}"
