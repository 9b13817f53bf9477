"""The local autoscaler's decisions: when to start a worker in a pool and which one to drain.

Pure logic, no processes: each tick the gateway hands over one :class:`PoolObservation` per pool (its workers and
their states, the pool's predicted queue wait, queued requests, pressure level and utilisation) and gets back
:class:`ScaleDecision` values that ``gateway.local_workers`` carries out (spawn ``sluice worker``; send ``Drain``
and stop the worker once it is empty).

Rules, per pool, in this order (n = the pool's local workers that are starting or ready; remote workers that joined
through the registry serve the pool but are never started, stopped or counted against ``max_workers``):

1. ``below_min_workers``: n < ``min_workers`` → start the missing ones at once.
2. ``queued_without_worker``: a request is queued and no worker is ready or starting → start at once as many as
   the offered load needs (rule 3's count, at least one): scale from zero; the request waits through the cold
   start in its tier queue, its deadline still holds.
3. ``demand_above_capacity``: the offered load — expected work tokens that arrived over the last
   ``autoscale.demand_window_s`` w (or over a tenth of it, when higher: a burst beginning), admitted or not — needs
   more workers than are ready or starting, at each worker's measured service rate and
   ``autoscale.target_utilisation``, when it may be served within the window plus the pool's
   ``target_queue_wait_s`` T: ``ceil(work ÷ (rate × target × (w + T)))`` (``gateway.fleet.fleet``; a burst the queue
   absorbs within T starts no worker). Start the difference at once, without
   waiting for a queue to build (the load-proportional rule of Knative's autoscaler: desired pods = observed load ÷
   target load per pod) — also while the pool's first workers are still starting, so a burst that grows during a
   cold start from zero does not wait for it to end before more start. The rate is the one admission measured
   while its queue was backlogged (or the workers' reported rates), remembered across a scale to zero.
4. Scale up, when the up condition has held for ``scale_up_after_s``:

   - ``queue_wait_above_target``: predicted queue wait w > ``target_queue_wait_s``. Start enough workers that the
     same work spread over more ready workers meets the target, counting workers already starting:
     ``ceil(ready × w ÷ target) − (ready + starting)``, at least one when none is starting (the proportional rule
     of the Kubernetes Horizontal Pod Autoscaler: desired = ceil(current × metric ÷ target)).
   - ``pressure``: pressure level ≥ elevated while the pool is busy (requests queued, or utilisation at least
     ``autoscale.scale_down_utilisation``: a level that lingers through its hysteresis over an idle pool, e.g.
     after a wait through a cold start, is no reason) and the wait rule did not fire → one worker, unless one is
     starting.

   After a start the condition must hold for another ``scale_up_after_s`` before the next one.
5. Scale down, when no request is queued, nothing is starting, the offered load fits on one worker
   fewer (rule 3's count < ready) and use has been low for ``scale_down_after_s``:
   ``low_utilisation`` — with r ready workers at utilisation u, the work would still be in low use on one worker
   fewer: u × r ÷ (r − 1) < ``autoscale.scale_down_utilisation`` (for r = 1: u = 0, ``idle``). The victim is the
   ready local worker with the fewest requests in flight, the most recently started on a tie. After a stop the low
   use must last another ``scale_down_after_s`` before the next one, except when the pool is idle (no use, no
   offered load): then one more worker stops each tick, so an idle pool reaches ``min_workers`` within a few ticks
   of ``scale_down_after_s``. Never below ``min_workers``. The pressure level is not a condition: it comes from
   the queue wait and the KV usage, and with no request queued and low use what is left of it is the hysteresis
   of its way down (``pressure.min_dwell_s`` per level), which would hold a burst's workers idle for seconds after
   the burst. Nor is a worker still draining: it finishes its last answers (an answer of a few hundred tokens
   takes seconds) while the next low-use window runs on the workers still ready.

Cold starts (spawn → ``Hello``) are measured per pool (:meth:`Autoscaler.record_cold_start`); their mean over the
last few starts feeds :meth:`Autoscaler.predicted_wait_s`, the wait a request arriving now must expect when the
pool has no ready worker.

::

    up condition   ────┐ ██████████████████████████████ ┌───
                       └──────────────────────────────────┘
                       |← scale_up_after_s →| start      |← scale_up_after_s →| start (if still needed)
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.pressure import PressureLevel
from shared.config import DEFAULT_COLD_START_S, AutoscaleConfig, PoolConfig

# Cold starts averaged into the estimate (the most recent ones).
COLD_START_SAMPLES = 5


class WorkerState(str, enum.Enum):
    """A worker's state as the autoscaler sees it."""

    STARTING = "starting"  # spawned, no Hello yet
    READY = "ready"  # takes requests
    DRAINING = "draining"  # finishes what it has, takes nothing new; stopped when empty


class ScaleAction(str, enum.Enum):
    """What a decision asks for."""

    UP = "up"
    DOWN = "down"


class ScaleReason(str, enum.Enum):
    """Why a decision was made (a label of the scale-event metric and of ``/status``)."""

    BELOW_MIN_WORKERS = "below_min_workers"
    QUEUED_WITHOUT_WORKER = "queued_without_worker"
    DEMAND_ABOVE_CAPACITY = "demand_above_capacity"
    QUEUE_WAIT_ABOVE_TARGET = "queue_wait_above_target"
    PRESSURE = "pressure"
    LOW_UTILISATION = "low_utilisation"
    IDLE = "idle"


@dataclass(frozen=True)
class WorkerView:
    """One worker of a pool, as the autoscaler needs it.

    Attributes:
        worker_id: unique within the gateway.
        state: starting, ready or draining.
        started_at_s: clock time its process was spawned (for remote workers: when the gateway first saw it).
        num_in_flight: requests it is running for this gateway.
        local: True for a worker this gateway spawned (it may stop it); False for one that joined through the
            registry.
    """

    worker_id: str
    state: WorkerState
    started_at_s: float
    num_in_flight: int = 0
    local: bool = True


@dataclass(frozen=True)
class PoolObservation:
    """What the autoscaler sees of one pool at one tick.

    Attributes:
        pool: the pool's name.
        workers: every worker of the pool (local and remote) in any state.
        predicted_queue_wait_s: admission's predicted queue wait in seconds of the work queued for this pool over
            its ready workers; None when unknown (no drain rate measured yet).
        num_queued: requests waiting in tier queues for this pool.
        pressure: the pressure level that applies to this pool.
        utilisation: in-flight demand ÷ capacity of the pool's ready workers, 0–1 (KV tokens or running sequences,
            whichever is fuller).
        demand_workers: workers the offered load needs (load ÷ (per-worker service rate × target utilisation),
            not rounded); None when no service rate is known yet.
    """

    pool: str
    workers: Sequence[WorkerView]
    predicted_queue_wait_s: float | None = None
    num_queued: int = 0
    pressure: PressureLevel = PressureLevel.NORMAL
    utilisation: float = 0.0
    demand_workers: float | None = None


@dataclass(frozen=True)
class ScaleDecision:
    """Start workers in a pool, or drain one.

    Attributes:
        pool: the pool's name.
        action: up (start ``num_workers`` local workers) or down (drain and stop ``worker_id``).
        reason: why.
        at_s: clock time of the decision.
        num_workers: workers to start (up) or 1 (down).
        worker_id: the worker to drain (down); "" for up.
        detail: the numbers behind the decision, for logs and ``/status``.
    """

    pool: str
    action: ScaleAction
    reason: ScaleReason
    at_s: float
    num_workers: int = 1
    worker_id: str = ""
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (for ``/status``)."""
        return {
            "pool": self.pool,
            "action": self.action.value,
            "reason": self.reason.value,
            "at_s": round(self.at_s, 3),
            "num_workers": self.num_workers,
            "worker_id": self.worker_id,
            "detail": self.detail,
        }


@dataclass
class _PoolState:
    config: PoolConfig
    up_since_s: float | None = None
    low_since_s: float | None = None
    cold_starts_s: deque[float] = field(default_factory=lambda: deque(maxlen=COLD_START_SAMPLES))
    num_cold_starts: int = 0


class Autoscaler:
    """Decide, per pool and per tick, which local workers to start and which to drain (see the module docstring).

    Args:
        pools: the pools (``shared.config.effective_pools``).
        config: the ``[autoscale]`` section.
        clock: monotonic time in seconds (injectable for tests).
    """

    def __init__(self, pools: Iterable[PoolConfig], config: AutoscaleConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._pools = {pool.name: _PoolState(pool) for pool in pools}
        self.events: deque[ScaleDecision] = deque(maxlen=config.max_events)

    # ----------------------------------------------------------------------------------------------- decisions

    def tick(self, observations: Iterable[PoolObservation]) -> list[ScaleDecision]:
        """Return this tick's decisions for the observed pools (recorded in :attr:`events` as well).

        Raises:
            KeyError: an observation names an unknown pool (a bug: pools come from the same config).
        """
        now_s = self._clock()
        decisions: list[ScaleDecision] = []
        for observation in observations:
            decision = self._decide(self._pools[observation.pool], observation, now_s)
            if decision is not None:
                decisions.append(decision)
                self.events.append(decision)
        return decisions

    def _decide(self, state: _PoolState, obs: PoolObservation, now_s: float) -> ScaleDecision | None:
        pool = state.config
        local_active = [w for w in obs.workers if w.local and w.state is not WorkerState.DRAINING]
        num_starting = sum(1 for w in obs.workers if w.state is WorkerState.STARTING)
        num_ready = sum(1 for w in obs.workers if w.state is WorkerState.READY)
        num_local = len(local_active)
        min_workers = pool.min_workers
        max_workers = pool.max_workers if self._config.enabled else pool.min_workers

        if num_local < min_workers:
            state.up_since_s = state.low_since_s = None
            return self._up(pool, ScaleReason.BELOW_MIN_WORKERS, now_s, min_workers - num_local,
                            f"{num_local} local workers < min_workers {min_workers}")
        if not self._config.enabled:
            return None
        needed = math.ceil(obs.demand_workers - 1e-9) if obs.demand_workers is not None else None
        if obs.num_queued > 0 and num_ready == 0 and num_starting == 0 and num_local < max_workers:
            state.up_since_s = state.low_since_s = None
            count = min(max(1, needed or 1), max_workers) - num_local
            return self._up(pool, ScaleReason.QUEUED_WITHOUT_WORKER, now_s, max(1, count),
                            f"{obs.num_queued} requests queued, no worker ready or starting"
                            + ("" if obs.demand_workers is None
                               else f"; offered load needs {obs.demand_workers:.2f} workers"))
        if (needed is not None and num_ready + num_starting > 0 and needed > num_ready + num_starting
                and num_local < max_workers):
            add = min(needed, max_workers) - (num_ready + num_starting)
            add = min(add, max_workers - num_local)
            if add > 0:
                state.up_since_s = state.low_since_s = None
                return self._up(pool, ScaleReason.DEMAND_ABOVE_CAPACITY, now_s, add,
                                f"offered load needs {obs.demand_workers:.2f} workers; {num_ready} ready, "
                                f"{num_starting} starting")

        wait_s = obs.predicted_queue_wait_s
        wait_high = num_ready > 0 and wait_s is not None and wait_s > pool.target_queue_wait_s
        busy = obs.num_queued > 0 or obs.utilisation >= self._config.scale_down_utilisation
        pressure_high = obs.pressure >= PressureLevel.ELEVATED and busy
        if wait_high or pressure_high:
            state.low_since_s = None
            if state.up_since_s is None:
                state.up_since_s = now_s
            if now_s - state.up_since_s < pool.scale_up_after_s or num_local >= max_workers:
                return None
            if wait_high:
                needed = math.ceil(num_ready * wait_s / pool.target_queue_wait_s)
                add = needed - (num_ready + num_starting)
                if num_starting == 0:
                    add = max(add, 1)
                reason = ScaleReason.QUEUE_WAIT_ABOVE_TARGET
                detail = (f"predicted wait {wait_s:.2f} s > target {pool.target_queue_wait_s:g} s with "
                          f"{num_ready} ready, {num_starting} starting")
            else:
                add = 0 if num_starting else 1
                reason = ScaleReason.PRESSURE
                detail = f"pressure {obs.pressure.label} for {now_s - state.up_since_s:.1f} s"
            add = min(add, max_workers - num_local)
            if add <= 0:
                return None
            state.up_since_s = now_s
            return self._up(pool, reason, now_s, add, detail)
        state.up_since_s = None
        return self._maybe_down(state, obs, now_s, num_starting, num_local)

    def _maybe_down(self, state: _PoolState, obs: PoolObservation, now_s: float, num_starting: int,
                    num_local: int) -> ScaleDecision | None:
        pool = state.config
        ready = [w for w in obs.workers if w.state is WorkerState.READY]
        candidates = [w for w in ready if w.local]
        num_ready = len(ready)
        if num_ready == 1:
            low = obs.utilisation <= 0.0
            projected = 0.0 if low else math.inf
        elif num_ready > 1:
            projected = obs.utilisation * num_ready / (num_ready - 1)
            low = projected < self._config.scale_down_utilisation
        else:
            low, projected = False, math.inf
        demand_fits = obs.demand_workers is None or math.ceil(obs.demand_workers - 1e-9) < num_ready
        idle = obs.utilisation <= 0.0 and not obs.demand_workers
        eligible = (low and demand_fits and obs.num_queued == 0
                    and num_starting == 0 and candidates and num_local > pool.min_workers)
        if not eligible:
            state.low_since_s = None
            return None
        if state.low_since_s is None:
            state.low_since_s = now_s
        if now_s - state.low_since_s < pool.scale_down_after_s:
            return None
        victim = min(candidates, key=lambda w: (w.num_in_flight, -w.started_at_s))
        if not idle:
            state.low_since_s = now_s  # an idle pool keeps its timer: the next tick stops the next worker
        reason = ScaleReason.IDLE if obs.utilisation <= 0.0 else ScaleReason.LOW_UTILISATION
        detail = (f"utilisation {obs.utilisation:.2f} over {num_ready} ready workers, {projected:.2f} over one fewer, "
                  f"for {pool.scale_down_after_s:g} s")
        return ScaleDecision(pool.name, ScaleAction.DOWN, reason, now_s, 1, victim.worker_id, detail)

    @staticmethod
    def _up(pool: PoolConfig, reason: ScaleReason, now_s: float, count: int, detail: str) -> ScaleDecision:
        return ScaleDecision(pool.name, ScaleAction.UP, reason, now_s, count, "", detail)

    # ----------------------------------------------------------------------------------------------- cold starts

    def record_cold_start(self, pool: str, seconds: float) -> None:
        """Record one measured cold start (spawn → Hello) of a worker of ``pool``, in seconds."""
        state = self._pools[pool]
        state.cold_starts_s.append(seconds)
        state.num_cold_starts += 1

    def cold_start_s(self, pool: str) -> float:
        """Return the expected cold start of ``pool`` in seconds: the mean of the last measured ones, else
        ``autoscale.initial_cold_start_s``, else :data:`~shared.config.DEFAULT_COLD_START_S`."""
        samples = self._pools[pool].cold_starts_s
        if samples:
            return sum(samples) / len(samples)
        initial_s = self._config.initial_cold_start_s
        return DEFAULT_COLD_START_S if initial_s is None else initial_s

    def cold_start_known(self, pool: str) -> bool:
        """Return whether :meth:`cold_start_s` is more than a default: measured here, or set by the operator
        (``autoscale.initial_cold_start_s``). Only a known cold start turns a request away at once."""
        return bool(self._pools[pool].cold_starts_s) or self._config.initial_cold_start_s is not None

    def predicted_wait_s(self, obs: PoolObservation) -> float | None:
        """Return the queue wait in seconds a request for this pool must expect now, cold starts included.

        With a ready worker: the observed predicted queue wait. With none but some starting: the cold start left of
        the one that started first (expected duration − time since spawn, at least 0). With none at all: a full
        cold start when the pool may start a worker (``max_workers`` > 0; with autoscaling off, ``min_workers`` >
        0), else None (no worker will come).
        """
        now_s = self._clock()
        if any(w.state is WorkerState.READY for w in obs.workers):
            return obs.predicted_queue_wait_s
        starting = [w.started_at_s for w in obs.workers if w.state is WorkerState.STARTING]
        cold_start_s = self.cold_start_s(obs.pool)
        if starting:
            return max(0.0, min(starting) + cold_start_s - now_s)
        pool = self._pools[obs.pool].config
        may_start = pool.max_workers > 0 if self._config.enabled else pool.min_workers > 0
        return cold_start_s if may_start else None

    # ----------------------------------------------------------------------------------------------- reports

    def snapshot(self) -> dict[str, Any]:
        """Return per pool the cold-start estimate and count, and the recent scale events (for ``/status``)."""
        return {
            "enabled": self._config.enabled,
            "pools": {
                name: {
                    "min_workers": state.config.min_workers,
                    "max_workers": state.config.max_workers,
                    "cold_start_s": round(self.cold_start_s(name), 3),
                    "num_cold_starts": state.num_cold_starts,
                }
                for name, state in self._pools.items()
            },
            "events": [event.as_dict() for event in self.events],
        }


class WorkerSecondsMeter:
    """Count worker-seconds per pool: every second a local worker process exists (starting, ready or draining).

    Args:
        clock: monotonic time in seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._running: dict[tuple[str, str], float] = {}  # (pool, worker id) → start time s
        self._done_s: dict[str, float] = {}

    def started(self, pool: str, worker_id: str) -> None:
        """Start counting a worker of ``pool`` (idempotent)."""
        self._running.setdefault((pool, worker_id), self._clock())

    def stopped(self, pool: str, worker_id: str) -> None:
        """Stop counting a worker (no-op when it was not counted)."""
        start_s = self._running.pop((pool, worker_id), None)
        if start_s is not None:
            self._done_s[pool] = self._done_s.get(pool, 0.0) + self._clock() - start_s

    def worker_seconds(self, pool: str) -> float:
        """Return the worker-seconds of ``pool`` so far, running workers included."""
        now_s = self._clock()
        running_s = sum(now_s - start_s for (name, _), start_s in self._running.items() if name == pool)
        return self._done_s.get(pool, 0.0) + running_s

    def pools(self) -> list[str]:
        """Return every pool that has had a worker."""
        return sorted({pool for pool, _ in self._running} | set(self._done_s))
