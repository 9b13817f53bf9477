"""Start local worker processes: forked from a fork server that imported the worker once, or a fresh interpreter.

A cold start is time a request at an empty pool waits, and capacity a burst does not get, so it is worth
cutting. A fresh ``python -m sluice.cli worker`` first imports the worker's modules: about 0.25 s of CPU for a sim
worker, about 2 s more with torch and transformers. Several workers starting at once on a busy gateway machine share
its cores: on the autoscaling bench (2 cores, the gateway and the load generator busy with a burst) four sim workers
started together took 1.1–1.8 s from spawn to Hello.

``gateway.worker_start_method``:

- ``forkserver`` (the default on Linux): CPython's multiprocessing fork server (the start method of that name). One
  process, started with the gateway, imports the worker's modules once (:func:`preload_modules`: torch and
  transformers too when a pool runs a model) and forks each worker from that state, as Android's zygote does. A
  worker then pays only its own set-up (model load, KV pool). CUDA is never initialised in the fork server (importing
  torch does not initialise it), so each forked worker initialises it itself, after its ``CUDA_VISIBLE_DEVICES`` is
  set.
- ``exec``: ``python -m sluice.cli worker`` in a new interpreter.

Either way a worker dies with the gateway. An exec'd worker gets ``PR_SET_PDEATHSIG = SIGTERM`` towards the gateway.
A forked one is the fork server's child, so it watches the gateway itself: its ``multiprocessing.parent_process()``
sentinel (the pipe the gateway sent it its start over) reads end-of-file once the gateway is gone, and a thread then
sends the worker SIGTERM; it also gets ``PR_SET_PDEATHSIG`` towards the fork server. (The fork server alone would not
do: it exits when the gateway's end of its "alive" pipe closes, but multiprocessing hands every child a copy of that
end, so the fork server lives as long as any of its workers.) On a clean exit the gateway stops each worker
(SIGTERM, then SIGKILL), and forked workers are daemonic: the interpreter's exit terminates any left.

Either way a worker runs in a process group of its own (:mod:`gateway.fleet.forkserver_group`): a signal to the
gateway's group (Ctrl-C) reaches the gateway alone, which drains before it stops its workers.

Both kinds of process are driven through :class:`WorkerProcess` (``pid``, ``returncode``, ``wait``, ``terminate``,
``kill``), the interface of ``asyncio.subprocess.Process``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

PR_SET_PDEATHSIG = 1
# Seconds a stopping worker gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 10.0
START_METHODS = ("forkserver", "exec")
FORKSERVER_GROUP_MODULE = "gateway.fleet.forkserver_group"  # imported by the fork server only
# What every worker imports (worker/__main__.py and what build_worker imports for any backend).
PRELOAD_WORKER = ("worker.__main__", "worker.engine", "worker.kv_cache.manager", "worker.scheduler",
                  "worker.server", "worker.backends.sim", "uvloop")
# What a worker that runs a model imports on top (seconds of a cold start on this machine).
PRELOAD_MODEL = ("torch", "transformers", "worker.model", "worker.model_runner", "worker.kv_cache.offload.chain")


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_exec_worker() -> None:
    """The ``preexec_fn`` of an exec'd worker: die with the gateway (:func:`die_with_parent`), in a process group of
    its own, outside the gateway's (:mod:`gateway.fleet.forkserver_group` says why)."""
    die_with_parent()
    os.setpgrp()


def preload_modules(backends: Iterable[str]) -> list[str]:
    """Return the modules the fork server imports for pools of these backends (``sim``, ``cpu``, ``cuda``, ``auto``):
    the worker's own, plus torch and transformers unless every pool is a simulator."""
    modules = list(PRELOAD_WORKER)
    if any(backend != "sim" for backend in backends):
        modules += PRELOAD_MODEL
    return modules


def run_forked_worker(argv: Sequence[str], env: dict[str, str]) -> None:
    """Run ``sluice worker argv`` in a process the fork server forked (the target of its ``Process``).

    Args:
        argv: the worker's arguments (after ``sluice worker``).
        env: its whole environment (replaces the fork server's, before anything reads it).

    Raises:
        SystemExit: always, with the worker's exit status (1 at once when the gateway is already gone).
    """
    import atexit

    die_with_parent()  # towards the fork server
    gateway = multiprocessing.parent_process()
    if gateway is not None:
        threading.Thread(target=_terminate_when_gone, args=(gateway.sentinel,), name="gateway-watch",
                         daemon=True).start()
    os.environ.clear()
    os.environ.update(env)
    atexit._clear()  # the fork server's exit handlers are not this worker's
    from sluice.cli import main  # the same entry point as an exec'd worker: the gateway never imports worker/

    try:
        code = main(["worker", *argv])
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child leaves through os._exit: run what the worker registered
    sys.exit(code)


def _terminate_when_gone(gateway_sentinel: int) -> None:
    """Block until the gateway's end of ``gateway_sentinel`` closes (the gateway died), then SIGTERM this process
    (the worker's graceful stop; before it installs its handler, the default action ends it)."""
    multiprocessing.connection.wait([gateway_sentinel])
    os.kill(os.getpid(), signal.SIGTERM)


class WorkerProcess(Protocol):
    """A running worker process: the part of ``asyncio.subprocess.Process`` the fleet uses."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ForkedProcess:
    """A worker forked by the fork server, behind the ``asyncio.subprocess.Process`` interface.

    Its exit is watched on the process's sentinel (the fork server writes the exit status there), so any number of
    coroutines may await :meth:`wait` at once.

    Args:
        process: a started ``multiprocessing`` process of the ``forkserver`` context.
        loop: the event loop that watches it.
    """

    def __init__(self, process: multiprocessing.process.BaseProcess, loop: asyncio.AbstractEventLoop) -> None:
        self._process = process
        self._loop = loop
        self._exited = loop.create_future()
        self._sentinel = process.sentinel
        loop.add_reader(self._sentinel, self._on_sentinel)

    def _on_sentinel(self) -> None:
        self._loop.remove_reader(self._sentinel)
        self._process.join()  # reads the exit status from the sentinel; returns at once
        if not self._exited.done():
            self._exited.set_result(self._process.exitcode)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal) once the exit was seen, else None."""
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        """Wait for the process to exit; return its exit status."""
        return await asyncio.shield(self._exited)

    def terminate(self) -> None:
        """Send SIGTERM (no-op once it exited)."""
        if self.returncode is None:
            self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL (no-op once it exited)."""
        if self.returncode is None:
            self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.kill(self._process.pid, sig)
        except ProcessLookupError:  # exited; the sentinel says so soon
            pass


class WorkerSpawner:
    """Start ``sluice worker`` processes with one of :data:`START_METHODS` (see the module docstring).

    Args:
        method: ``forkserver`` or ``exec``.
        preload: modules the fork server imports before it forks (:func:`preload_modules`).

    Raises:
        ValueError: an unknown method, or ``forkserver`` where the platform has none.
    """

    def __init__(self, method: str, preload: Sequence[str] = PRELOAD_WORKER) -> None:
        if method not in START_METHODS:
            raise ValueError(f"unknown worker start method {method!r}; valid: {', '.join(START_METHODS)}")
        if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
            raise ValueError("the forkserver start method is not available on this platform; use exec")
        self.method = method
        self._preload = list(preload)
        # one thread: starts are serialised (multiprocessing's bookkeeping is not thread-safe) and the event loop
        # never blocks on the fork server's socket
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._context = multiprocessing.get_context("forkserver") if method == "forkserver" else None

    def _ensure_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="worker-spawn")
            if self._context is not None:
                # first: the fork server leaves the gateway's process group before it forks any worker
                self._context.set_forkserver_preload([FORKSERVER_GROUP_MODULE, *self._preload])
        return self._executor

    def warm_up(self) -> None:
        """Start the fork server now, in the background, so the first cold start does not wait for its imports."""
        if self._context is not None:
            self._ensure_executor().submit(multiprocessing.forkserver.ensure_running)

    async def spawn(self, argv: Sequence[str], env: dict[str, str], name: str) -> WorkerProcess:
        """Start one worker with arguments ``argv`` (after ``sluice worker``) and environment ``env``.

        Raises:
            OSError: the process could not be started.
        """
        if self._context is None:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sluice.cli", "worker", *argv, env=env, preexec_fn=start_exec_worker)
        loop = asyncio.get_running_loop()
        executor = self._ensure_executor()

        def start() -> multiprocessing.process.BaseProcess:
            process = self._context.Process(target=run_forked_worker, args=(list(argv), env),
                                            name=name, daemon=True)
            process.start()
            return process

        process = await loop.run_in_executor(executor, start)
        return ForkedProcess(process, loop)

    def close(self) -> None:
        """Stop the spawn thread (the fork server exits with the gateway)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

