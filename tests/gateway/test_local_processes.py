"""``gateway.fleet.local_processes``: a local worker that stops on its configuration is not restarted, and its
pool says why; one that exits any other way before it is ready is restarted after a backoff."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import msgspec
import pytest

from gateway.fleet.autoscaler import WorkerSecondsMeter
from gateway.fleet.fleet import Fleet
from gateway.fleet.local_processes import LocalProcesses
from gateway.metrics import Metrics
from shared.config import Config
from shared.errors import ErrorCode, SluiceError

WAIT_S = 60.0


def one_pool_config(env: dict[str, str] | None = None, backoff_s: float = 1.0) -> Config:
    return msgspec.convert({
        "gateway": {"worker_start_method": "exec", "worker_restart_backoff_s": backoff_s},
        "pools": [{"name": "default", "backend": "sim", "min_workers": 1, "max_workers": 1, "env": env or {}}],
    }, Config)


async def test_a_worker_that_stops_on_its_config_is_not_restarted_and_its_pool_says_why():
    """The user trial: ``block_size_tokens = 100000`` made every start exit with status 2, and the gateway restarted
    the worker forever. A real ``sluice worker`` (exec'd, sim backend) refuses the override here."""
    fleet = Fleet(one_pool_config({"SLUICE_WORKER__BLOCK_SIZE_TOKENS": "100000"}), Metrics())
    runtime = fleet.runtimes["default"]
    try:
        assert fleet.local.spawn(runtime)
        await asyncio.wait_for(fleet.unservable.wait(), WAIT_S)
        assert "worker.block_size_tokens = 100000" in runtime.config_error, runtime.config_error
        assert fleet.unservable_reason == f"pool default: {runtime.config_error}"
        assert "not restarted" in runtime.last_start_failure and runtime.spawn_failures == 0  # no backoff loop
        assert not fleet.local.spawn(runtime) and not fleet.scaling.may_spawn(runtime) and not runtime.local
        assert not fleet.is_ready() and fleet.config_errors() == {"default": runtime.config_error}
        assert fleet.snapshot()["pools"]["default"]["config_error"] == runtime.config_error
        with pytest.raises(SluiceError) as info:
            fleet.check_cold_start(runtime, "standard")
        assert info.value.code is ErrorCode.NO_WORKER and runtime.config_error in str(info.value)
        assert not any(name.endswith(".exit-reason") and f"-{os.getpid()}-" in name for name in os.listdir("/tmp"))
    finally:
        await fleet.close()


class ExitingSpawner:
    """Starts, instead of a worker, a Python process that runs ``code`` (a crash, a kill) and counts the starts."""

    method = "exec"

    def __init__(self, code: str) -> None:
        self.code = code
        self.num_spawns = 0

    async def spawn(self, argv, env, name):
        self.num_spawns += 1
        return await asyncio.create_subprocess_exec(sys.executable, "-c", self.code)


@pytest.mark.parametrize("code, returncode", [
    ("import sys; print('Traceback: boom', file=sys.stderr); sys.exit(1)", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
])
async def test_a_worker_that_exits_otherwise_before_it_is_ready_is_restarted_after_a_backoff(code, returncode):
    config = one_pool_config(backoff_s=0.2)
    fleet = Fleet(config, Metrics(), spawn_local=False)
    runtime = fleet.runtimes["default"]
    exited = asyncio.Event()
    spawner = ExitingSpawner(code)
    local = LocalProcesses(config, Metrics(), WorkerSecondsMeter(time.monotonic), spawner, time.monotonic, None,
                           lambda pool, seconds: None, exited.set)
    try:
        assert local.spawn(runtime)
        await asyncio.wait_for(exited.wait(), WAIT_S)
        assert runtime.config_error is None and runtime.spawn_failures == 1
        assert f"exited with status {returncode} before it was ready" in runtime.last_start_failure
        assert not local.spawn(runtime)  # within the backoff
        await asyncio.sleep(0.25)
        exited.clear()
        assert local.spawn(runtime)
        await asyncio.wait_for(exited.wait(), WAIT_S)
        assert spawner.num_spawns == 2 and runtime.spawn_failures == 2
    finally:
        await local.close([runtime])
        await fleet.close()
