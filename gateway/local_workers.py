"""Local worker processes that ``sluice serve`` spawns, restarts when they die, and stops on exit.

Each worker is ``python -m sluice.cli worker --listen unix:/tmp/sluice-<gateway pid>-<i>.sock [--config F]`` with
the gateway's environment (so ``SLUICE_*`` overrides apply). The child gets ``PR_SET_PDEATHSIG = SIGTERM`` (Linux),
so it never outlives a gateway that is killed; on a clean exit the gateway sends SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import sys

import structlog

from gateway.spawn import die_with_parent as _die_with_parent
from gateway.workers import WorkerClient

log = structlog.get_logger("sluice.gateway")

STOP_GRACE_S = 10.0


def socket_path(index: int) -> str:
    """Return the Unix socket path of local worker ``index`` of this gateway process."""
    return f"/tmp/sluice-{os.getpid()}-{index}.sock"


class LocalWorkerProcess:
    """Supervise one local worker process: start it, restart it after it dies, stop it.

    Args:
        index: the worker's number on this machine (names its socket).
        client: the :class:`WorkerClient` connected to its socket (used to detect a worker that never says Hello).
        config_path: the config file passed to the worker, or None for the worker's default resolution.
        restart_backoff_s: wait before restarting a worker that exited.
        start_timeout_s: a worker that has not said Hello by then is killed and restarted.
    """

    def __init__(self, index: int, client: WorkerClient, config_path: str | None, restart_backoff_s: float,
                 start_timeout_s: float) -> None:
        self.index = index
        self.client = client
        self.config_path = config_path
        self.restart_backoff_s = restart_backoff_s
        self.start_timeout_s = start_timeout_s
        self.num_starts = 0
        self._process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def address(self) -> str:
        return f"unix:{socket_path(self.index)}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "sluice.cli", "worker", "--listen", self.address,
                "--worker-id", f"local-{os.getpid()}-{self.index}"]
        if self.config_path:
            argv += ["--config", self.config_path]
        return argv

    def start(self) -> None:
        """Start the supervision loop (owned by this object; :meth:`stop` ends it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"local-worker-{self.index}")

    async def _supervise(self) -> None:
        while not self._stopping:
            self._process = await asyncio.create_subprocess_exec(
                *self.command(), env=dict(os.environ), preexec_fn=_die_with_parent)
            self.num_starts += 1
            log.info("local_worker_started", index=self.index, pid=self._process.pid, address=self.address,
                     start=self.num_starts)
            watchdog = asyncio.create_task(self._start_watchdog(self._process))
            try:
                returncode = await self._process.wait()
            finally:
                watchdog.cancel()
            if self._stopping:
                break
            log.error("local_worker_exited", index=self.index, returncode=returncode,
                      restart_in_s=self.restart_backoff_s)
            await asyncio.sleep(self.restart_backoff_s)

    async def _start_watchdog(self, process: asyncio.subprocess.Process) -> None:
        if await self.client.wait_ready(self.start_timeout_s):
            return
        log.error("local_worker_start_timeout", index=self.index, pid=process.pid, timeout_s=self.start_timeout_s)
        if process.returncode is None:
            process.kill()

    async def stop(self) -> None:
        """Stop supervising; SIGTERM the worker, SIGKILL it after ``STOP_GRACE_S``; remove its socket."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), STOP_GRACE_S)
            except TimeoutError:
                log.warning("local_worker_kill", index=self.index, pid=process.pid)
                process.kill()
                await process.wait()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        try:
            os.unlink(socket_path(self.index))
        except FileNotFoundError:
            pass
