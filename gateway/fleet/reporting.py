"""What the fleet reports: ``/status`` (workers, local processes, pools, merged admission) and Prometheus."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.admission.stats import AdmissionStats, merge_admission_stats
from gateway.fleet.autoscaler import Autoscaler, WorkerSecondsMeter, WorkerState
from gateway.fleet.pools import PoolRuntime
from gateway.workers.status import WorkerStatus
from shared.config import Config


class FleetReport:
    """Read the fleet's state for ``/status`` and metrics (never changes it).

    Args:
        config: the whole config.
        runtimes: the pools by name; ``default``: the first pool.
        autoscaler, meter: the scaling policy (cold starts, recent decisions) and the worker-seconds meter.
        scale_events: autoscaler actions carried out, by (pool, action, reason).
        degraded: requests served by their tier's degrade pool, by (tier, pool).
        clock: monotonic seconds.
    """

    def __init__(self, config: Config, runtimes: dict[str, PoolRuntime], default: PoolRuntime, autoscaler: Autoscaler,
                 meter: WorkerSecondsMeter, scale_events: Counter[tuple[str, str, str]],
                 degraded: Counter[tuple[str, str]], clock: Callable[[], float]) -> None:
        self._config = config
        self.runtimes = runtimes
        self._default = default
        self._autoscaler = autoscaler
        self._meter = meter
        self._scale_events = scale_events
        self.degraded = degraded
        self._clock = clock
        # the registry watcher's health (``RegistryWatcher.health``), None without a registry; set by the fleet
        self.registry_health: Callable[[], dict[str, Any] | None] = lambda: None

    def worker_status(self) -> list[WorkerStatus]:
        """Return every worker of every pool (``WorkerPool.status`` entries with ``pool``, ``local``, ``state``)."""
        out: list[WorkerStatus] = []
        for runtime in self.runtimes.values():
            states = {lw.client.name: lw.state.value for lw in runtime.local.values()}
            for entry in runtime.pool.status():
                entry.pool = runtime.name
                entry.local = entry.name in states
                entry.state = states.get(entry.name, entry.state)
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

    def admission_stats(self) -> AdmissionStats:
        """Return the pools' admission stats merged per tier (counts summed, the highest pressure level)."""
        stats = {name: runtime.admission.stats() for name, runtime in self.runtimes.items()}
        return merge_admission_stats(stats, self._default.name)

    def snapshot(self) -> dict[str, Any]:
        """Return pools (workers by state, worker-seconds, cost, cold starts, degraded requests, the configuration
        error that stopped its local workers), scale events,
        and the autoscaler's recent decisions (for ``/status``)."""
        scaler = self._autoscaler.snapshot()
        pools: dict[str, Any] = {}
        now_s = self._clock()
        for name, runtime in self.runtimes.items():
            states = Counter(lw.state.value for lw in runtime.local.values())
            for client, _ in runtime.remote.values():
                states["ready" if client.ready else "starting"] += 1
            worker_seconds = self._meter.worker_seconds(name)
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
                "config_error": runtime.config_error,
            }
        return {
            "autoscale_enabled": self._config.autoscale.enabled,
            "registry": self.registry_health(),
            "pools": pools,
            "scale_events": [
                {"pool": pool, "action": action, "reason": reason, "count": count}
                for (pool, action, reason), count in sorted(self._scale_events.items())
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
    ``sluice_degraded_requests_total{tier,pool}``; with a worker registry, ``sluice_registry_reachable`` and
    ``sluice_registry_errors_total``. (``sluice_worker_cold_start_seconds{pool}`` is a histogram observed live.)
    """

    def __init__(self, report: FleetReport, degraded: Counter[tuple[str, str]]) -> None:
        self._report = report
        self._degraded = degraded

    def collect(self) -> Iterable[Metric]:
        """Yield the metric families (called by the registry on every scrape)."""
        snapshot = self._report.snapshot()
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
        for (tier, pool), count in sorted(self._degraded.items()):
            degraded.add_metric([tier, pool], count)
        yield from (workers, seconds, cost, cold, events, degraded)
        registry = snapshot["registry"]
        if registry is not None:
            yield GaugeMetricFamily("sluice_registry_reachable", "1 when the last scan of the worker registry read "
                                    "Redis, else 0 (known workers are kept meanwhile)",
                                    value=int(registry["reachable"]))
            yield CounterMetricFamily("sluice_registry_errors", "Scans of the worker registry that failed",
                                      value=registry["errors"])
