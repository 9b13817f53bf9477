"""The registry's joins and leaves applied to the pools: connect to a worker that joined, let one that left finish.

::

    RegistryWatcher.events() ── join ──▶ connect, add to the pool serving its model
                             │           (the same worker back while it is still leaving: route to it again)
                             └─ leave ──▶ restarted: close now (its requests ended with the old process)
                                          deregistered, heartbeat_expired: route nothing new to it; close it once
                                          the requests it runs have ended (reserved, sent or streaming)

A worker that leaves the registry is not always gone: a Redis that restarts empty (no persistence, or a flush)
drops every entry, and each worker writes its own again at its next heartbeat (``registry.heartbeat_interval_s``).
Its connection is the real liveness signal, so a leave never cuts the requests a worker runs: a worker that exits
cleanly deregisters, finishes them and closes its connection; one that is gone ends them with its connection; one
that hangs ends them at the gateway's stall timeout. A worker that joins again under the same incarnation and
address while it is still leaving is routed to again, on the connection it has.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gateway.fleet.pools import PoolRuntime
from gateway.fleet.registry_watch import RegisteredWorker, RegistryEvent, RegistryEventKind
from gateway.workers.client import WorkerClient

log = structlog.get_logger("sluice.gateway")

LEAVE_POLL_S = 0.1  # how often a leaving worker is checked for requests left


@dataclass
class _Leaving:
    """A worker that left the registry and still runs requests."""

    runtime: PoolRuntime
    client: WorkerClient
    worker: RegisteredWorker
    task: asyncio.Task | None = None


class RegistryMembers:
    """Apply registry events to the pools (see the module docstring).

    Args:
        runtimes: the pools by name (a worker joins the one serving its ``hello.model_id``).
        add_remote: connects a new remote worker to a pool: ``(runtime, name, address) → client`` (not started).
        model_names: the served model names, for the log line of a worker whose model no pool serves.
        clock: monotonic seconds (a re-joined worker's first-seen time).
    """

    def __init__(self, runtimes: dict[str, PoolRuntime],
                 add_remote: Callable[[PoolRuntime, str, str], WorkerClient],
                 model_names: Callable[[], list[str]], clock: Callable[[], float]) -> None:
        self._runtimes = runtimes
        self._add_remote = add_remote
        self._model_names = model_names
        self._clock = clock
        self._leaving: dict[str, _Leaving] = {}

    @staticmethod
    def client_name(worker: RegisteredWorker) -> str:
        return f"registry-{worker.worker_id}"

    async def apply(self, event: RegistryEvent) -> None:
        """Apply one join or leave."""
        if event.kind is RegistryEventKind.JOIN:
            await self._join(event.worker)
        else:
            await self._leave(event.worker, event.reason)

    async def _join(self, worker: RegisteredWorker) -> None:
        name = self.client_name(worker)
        leaving = self._leaving.pop(name, None)
        if leaving is not None:
            if leaving.worker == worker:  # the same process, back in the registry: keep its connection
                self._stop_watching(leaving)
                leaving.client.resume_routing()
                leaving.runtime.remote[name] = (leaving.client, self._clock())
                log.info("registry_worker_back", worker_id=worker.worker_id, address=worker.address,
                         in_flight=leaving.client.num_in_flight)
                return
            await self._close(leaving, "restarted under the same id")
        runtime = next((r for r in self._runtimes.values() if r.config.model_name == worker.hello.model_id), None)
        if runtime is None:
            log.warning("registry_worker_unknown_model", worker_id=worker.worker_id, model=worker.hello.model_id,
                        served=self._model_names())
            return
        self._add_remote(runtime, name, worker.address).start()
        runtime.last_kv_blocks = runtime.last_kv_blocks or worker.hello.num_kv_blocks

    async def _leave(self, worker: RegisteredWorker, reason: str) -> None:
        name = self.client_name(worker)
        for runtime in self._runtimes.values():
            entry = runtime.remote.pop(name, None)
            if entry is None:
                continue
            leaving = _Leaving(runtime, entry[0], worker)
            if reason == "restarted":  # a new process under the same id: the old connection ended with the old one
                await self._close(leaving, "restarted")
                continue
            leaving.client.mark_draining()
            self._leaving[name] = leaving
            leaving.task = asyncio.create_task(self._close_when_idle(name, leaving, reason),
                                               name=f"registry-leave-{name}")

    async def _close_when_idle(self, name: str, leaving: _Leaving, reason: str) -> None:
        await leaving.client.wait_idle(LEAVE_POLL_S)
        if self._leaving.get(name) is leaving:
            del self._leaving[name]
        leaving.task = None
        await self._close(leaving, f"left the registry ({reason})")

    @staticmethod
    async def _close(leaving: _Leaving, reason: str) -> None:
        leaving.runtime.pool.remove_client(leaving.client)
        await leaving.client.close(reason)

    @staticmethod
    def _stop_watching(leaving: _Leaving) -> None:
        if leaving.task is not None:
            leaving.task.cancel()
            leaving.task = None

    async def close(self) -> None:
        """Stop waiting on leaving workers (the fleet closes every client of its pools)."""
        tasks = [leaving.task for leaving in self._leaving.values() if leaving.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._leaving.clear()
