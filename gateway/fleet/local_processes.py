"""The ``sluice worker`` processes a gateway runs for its pools: spawn (``gateway.fleet.spawn``), wait for Hello
(the cold start), supervise, drain and stop.

A scale-down never aborts a request: the worker is marked draining in the gateway (no new reservation), sent the
protocol's ``Drain``, and stopped (SIGTERM) only once every request of this gateway on it has ended.

A worker that exits with :data:`~shared.config.CONFIG_ERROR_EXIT_STATUS` before it is ready stopped on its
configuration, which no restart changes: its pool starts no local worker again in this run, and the worker's
one-line reason (``--exit-reason-file``) is logged once and shown by ``/readyz`` and ``/status``. Any other exit
before Hello (another status, a signal, a start timeout) is retried with an exponential backoff.

Every local worker requires the shared secret (``shared.auth``): the configured ``worker.secret``, else a random one
made for this gateway run, handed over in its environment (``SLUICE_WORKER__SECRET``), never on its command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from gateway.fleet.autoscaler import WorkerSecondsMeter, WorkerState
from gateway.fleet.pools import LocalWorker, PoolRuntime
from gateway.fleet.spawn import STOP_GRACE_S, WorkerSpawner
from gateway.metrics import Metrics
from gateway.workers.client import WorkerClient
from gateway.workers.connector import FIRST_CONNECT_INTERVAL_S
from gateway.workers.pool import WorkerPool
from shared.auth import new_secret
from shared.config import CONFIG_ERROR_EXIT_STATUS, Config, PoolConfig

log = structlog.get_logger("sluice.gateway")

# Seconds between two checks of a draining worker's remaining requests.
DRAIN_POLL_S = 0.05
# Longest wait, seconds, for requests admitted to a worker just before it was marked draining to be sent to it.
DRAIN_DISPATCH_WAIT_S = 2.0
# Longest pause before a new spawn after workers of a pool kept failing to start, seconds.
MAX_SPAWN_BACKOFF_S = 60.0
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
# Longest reason read from a worker's --exit-reason-file, characters.
MAX_EXIT_REASON_CHARS = 2000


def detect_gpu_ids() -> list[str]:
    """Return the CUDA device ids this machine has (``nvidia-smi -L``), [] when there is none or no driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def exit_reason_path(lw: LocalWorker) -> str:
    """Return the file a local worker writes the reason of a configuration error to (beside its socket)."""
    return lw.socket_path.removesuffix(".sock") + ".exit-reason"


def read_exit_reason(lw: LocalWorker) -> str | None:
    """Return the one-line reason the worker wrote on a configuration error (at most
    :data:`MAX_EXIT_REASON_CHARS`), or None when it wrote none (e.g. it died before it parsed its arguments)."""
    try:
        with open(exit_reason_path(lw), encoding="utf-8", errors="replace") as f:
            reason = f.read(MAX_EXIT_REASON_CHARS).strip()
    except OSError:
        return None
    return reason or None


def _toml_string(value: str) -> str:
    """Return ``value`` as a TOML basic string (for ``SLUICE_*`` overrides, which are parsed as TOML values)."""
    return json.dumps(value)


class LocalProcesses:
    """Start, supervise, drain and stop the local worker processes of every pool; owns their tasks.

    Args:
        config: the whole config (gateway start settings, breaker, pools).
        metrics: the gateway's metrics (capacity reports of the new workers).
        meter: the worker-seconds meter (a worker counts from spawn to exit).
        spawner: starts the processes (fork server or exec).
        clock: monotonic seconds.
        config_path: passed to the workers as ``--config`` (None: their default resolution).
        on_cold_start: called with (pool name, spawn → Hello seconds) when a worker says Hello.
        on_exit: called when a worker is gone (exited, stopped or failed to start): the autoscaler looks again.
        secret: the shared secret of the local workers; None = a random one for this run.
    """

    def __init__(self, config: Config, metrics: Metrics, meter: WorkerSecondsMeter, spawner: WorkerSpawner,
                 clock: Callable[[], float], config_path: str | None, on_cold_start: Callable[[str, float], None],
                 on_exit: Callable[[], None], secret: bytes | None = None) -> None:
        self.config = config
        self._secret = secret if secret is not None else new_secret()
        self.metrics = metrics
        self.meter = meter
        self._spawner = spawner
        self._clock = clock
        self.config_path = config_path
        self._on_cold_start = on_cold_start
        self._on_exit = on_exit
        self._devices: dict[str, list[str]] = {}
        self._worker_numbers = iter(range(1, 1 << 62))
        self._tasks: set[asyncio.Task] = set()
        self.closing = False

    async def close(self, runtimes: list[PoolRuntime]) -> None:
        """Stop every local worker of ``runtimes`` (SIGTERM, then SIGKILL) and cancel the supervising tasks."""
        self.closing = True
        await asyncio.gather(*(self.stop_process(lw) for runtime in runtimes for lw in list(runtime.local.values())))
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _pool_devices(self, runtime: PoolRuntime) -> list[str]:
        if runtime.name not in self._devices:
            config = runtime.config
            devices = list(config.devices)
            if not devices and config.backend == "cuda":
                devices = detect_gpu_ids()
            self._devices[runtime.name] = devices
        return self._devices[runtime.name]

    def spawn(self, runtime: PoolRuntime) -> bool:
        """Start one local worker for the pool; False when none may start now (no device free, backoff)."""
        now_s = self._clock()
        if self.closing or runtime.config_error is not None or now_s < runtime.spawn_blocked_until_s:
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
        # the label of logs and metrics: stable per slot (a replacement keeps it); "local-<slot>" without [[pools]]
        name = f"local-{index}" if not self.config.pools else f"{safe_pool}-{index}"
        client = WorkerClient(f"unix:{socket_path}", name, self.metrics.observe_capacity,
                              WorkerPool.make_breaker(self.config.breaker), FIRST_CONNECT_INTERVAL_S,
                              secret=self._secret)
        lw = LocalWorker(runtime.name, index, worker_id, socket_path, device, client, now_s)
        runtime.local[worker_id] = lw
        runtime.starts_by_index[index] += 1
        self.meter.started(runtime.name, worker_id)
        self.own(self._run_local(runtime, lw), f"local-worker-{worker_id}")
        return True

    def worker_env(self, pool: PoolConfig, device: str | None) -> dict[str, str]:
        """Return the environment of a local worker of ``pool`` (the gateway's, plus the pool's settings and the
        shared secret, which replaces any ``worker.secret_file``)."""
        env = dict(os.environ)
        env["SLUICE_WORKER__SECRET"] = _toml_string(self._secret.decode())
        env["SLUICE_WORKER__SECRET_FILE"] = '""'
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
        argv = ["--listen", f"unix:{lw.socket_path}", "--worker-id", lw.worker_id,
                "--exit-reason-file", exit_reason_path(lw)]
        if self.config_path:
            argv += ["--config", self.config_path]
        return argv

    async def _run_local(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
        """Spawn the worker, wait for its Hello (the cold start), then supervise it until it exits."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(exit_reason_path(lw))  # a stale one (an earlier gateway of the same pid) is not this worker's
        try:
            try:
                lw.process = await self._spawner.spawn(self.worker_args(lw),
                                                       self.worker_env(runtime.config, lw.device), lw.worker_id)
            except OSError as exc:
                log.error("local_worker_spawn_failed", pool=runtime.name, worker_id=lw.worker_id, error=str(exc))
                self._spawn_failed(runtime, f"local worker {lw.worker_id} could not be started: {exc}")
                return
            log.info("local_worker_spawned", pool=runtime.name, worker_id=lw.worker_id, pid=lw.process.pid,
                     device=lw.device, start_method=self._spawner.method)
            timeout_s = self.config.gateway.worker_start_timeout_s
            waited_s = await self._wait_socket(lw, timeout_s)
            lw.client.start()
            runtime.pool.add_client(lw.client)
            if await self._wait_hello(lw, max(FIRST_CONNECT_INTERVAL_S, timeout_s - waited_s)):
                self._on_ready(runtime, lw)
            returncode = await lw.process.wait()
            if not lw.stopping and returncode == CONFIG_ERROR_EXIT_STATUS and lw.cold_start_s is None:
                self._config_failed(runtime, lw, await asyncio.to_thread(read_exit_reason, lw))
            elif not lw.stopping:
                log.error("local_worker_exited", pool=runtime.name, worker_id=lw.worker_id, returncode=returncode,
                          state=lw.state.value)
                if lw.cold_start_s is None:
                    self._spawn_failed(runtime, f"local worker {lw.worker_id} exited with status {returncode} "
                                                "before it was ready (its log says why)")
        finally:
            if lw.process is not None and lw.process.returncode is None:
                lw.process.kill()
                await lw.process.wait()
            self._forget_local(runtime, lw)
            await lw.client.close()
            self._on_exit()

    @staticmethod
    async def _wait_socket(lw: LocalWorker, timeout_s: float) -> float:
        """Wait until the worker's socket file exists, the worker exits or ``timeout_s`` passes; return the seconds
        waited. Connecting before the worker listens fails with ENOENT, an expected part of its cold start that the
        client would otherwise log as a connect retry."""
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        while (not os.path.exists(lw.socket_path) and lw.process is not None and lw.process.returncode is None
               and loop.time() - started_s < timeout_s):
            await asyncio.sleep(FIRST_CONNECT_INTERVAL_S)
        return loop.time() - started_s

    async def _wait_hello(self, lw: LocalWorker, timeout_s: float) -> bool:
        """Return True once the worker said Hello within ``timeout_s``; False when it exited or timed out first
        (then it is killed)."""
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
            log.error("local_worker_start_timeout", worker_id=lw.worker_id,
                      timeout_s=self.config.gateway.worker_start_timeout_s)
            lw.process.kill()
            return False
        return True

    def _on_ready(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
        lw.cold_start_s = self._clock() - lw.spawned_at_s
        if lw.state is WorkerState.STARTING:
            lw.state = WorkerState.READY
        runtime.spawn_failures = 0
        runtime.last_start_failure = None
        if lw.client.hello is not None:
            runtime.last_kv_blocks = lw.client.hello.num_kv_blocks
        self._on_cold_start(runtime.name, lw.cold_start_s)
        log.info("local_worker_ready", pool=runtime.name, worker_id=lw.worker_id,
                 cold_start_s=round(lw.cold_start_s, 3))
        runtime.admission.on_capacity_changed()

    def _spawn_failed(self, runtime: PoolRuntime, why: str) -> None:
        runtime.spawn_failures += 1
        runtime.last_start_failure = why
        backoff_s = min(MAX_SPAWN_BACKOFF_S,
                        self.config.gateway.worker_restart_backoff_s * 2 ** (runtime.spawn_failures - 1))
        runtime.spawn_blocked_until_s = self._clock() + backoff_s
        log.warning("local_worker_spawn_backoff", pool=runtime.name, failures=runtime.spawn_failures,
                    backoff_s=backoff_s)

    def _config_failed(self, runtime: PoolRuntime, lw: LocalWorker, reason: str | None) -> None:
        """Stop starting local workers of the pool: one exited on its configuration, which a restart repeats."""
        if runtime.config_error is not None:
            return  # its siblings, started together, said the same
        runtime.config_error = reason or (f"exited with status {CONFIG_ERROR_EXIT_STATUS} (a configuration error) "
                                          "before it was ready; its 'sluice worker:' log line says why")
        runtime.last_start_failure = (f"local worker {lw.worker_id} stopped on a configuration error, not restarted: "
                                      f"{runtime.config_error}")
        log.error("local_worker_config_error", pool=runtime.name, worker_id=lw.worker_id,
                  returncode=CONFIG_ERROR_EXIT_STATUS, reason=runtime.config_error,
                  restart="none: fix the config and restart the gateway")
        runtime.admission.on_capacity_changed()  # no capacity is coming: queued requests need not wait for it

    def _forget_local(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
        if runtime.local.pop(lw.worker_id, None) is None:
            return
        runtime.pool.remove_client(lw.client)
        self.meter.stopped(runtime.name, lw.worker_id)
        for path in (lw.socket_path, exit_reason_path(lw)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def drain_and_stop(self, runtime: PoolRuntime, lw: LocalWorker) -> None:
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
        await client.wait_idle(DRAIN_POLL_S)
        await self.stop_process(lw)
        log.info("local_worker_stopped", pool=runtime.name, worker_id=lw.worker_id)

    async def stop_process(self, lw: LocalWorker) -> None:
        lw.stopping = True
        process = lw.process
        if process is None or process.returncode is not None:
            return
        lw.client.expect_exit()
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            log.warning("local_worker_kill", worker_id=lw.worker_id, pid=process.pid)
            process.kill()
            await process.wait()

    def own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
