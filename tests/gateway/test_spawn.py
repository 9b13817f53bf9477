"""gateway.fleet.spawn: local workers forked from the fork server, or exec'd, are real sim workers over a Unix socket.

Each test starts real processes and talks to them with the gateway's own :class:`WorkerClient`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gateway.fleet.spawn import PRELOAD_MODEL, PRELOAD_WORKER, START_METHODS, WorkerSpawner, preload_modules
from gateway.workers.client import WorkerClient
from gateway.workers.connector import FIRST_CONNECT_INTERVAL_S
from shared.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
SIM_ENV = {"SLUICE_WORKER__BACKEND": '"sim"'}


def socket_path(tag: str) -> str:
    """A Unix socket path short enough for the 108-byte limit (pytest's tmp_path may not be)."""
    return f"/tmp/sluice-test-spawn-{os.getpid()}-{tag}.sock"


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs: no such process, or a zombie nobody reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.parametrize("method", START_METHODS)
async def test_a_spawned_sim_worker_says_hello_with_its_own_environment_and_exits_0_on_sigterm(method):
    spawner = WorkerSpawner(method)
    path = socket_path(method)
    env = dict(os.environ, **SIM_ENV, SLUICE_MODEL__NAME='"spawned-sim"')
    process = await spawner.spawn(["--listen", f"unix:{path}", "--worker-id", f"w-{method}"], env, f"w-{method}")
    client = WorkerClient(f"unix:{path}", "w", first_connect_interval_s=FIRST_CONNECT_INTERVAL_S)
    client.start()
    try:
        assert await client.wait_ready(60)
        assert (client.hello.backend, client.hello.model_id, client.hello.worker_id) == (
            "sim", "spawned-sim", f"w-{method}")
        assert process.pid > 0 and process.returncode is None
        process.terminate()
        waits = await asyncio.wait_for(asyncio.gather(process.wait(), process.wait()), 30)
        assert waits == [0, 0]  # a clean stop, seen by every waiter
        assert process.returncode == 0
    finally:
        await client.close()
        if process.returncode is None:
            process.kill()
            await process.wait()
        spawner.close()


@pytest.mark.parametrize("method", START_METHODS)
async def test_a_worker_that_fails_to_start_reports_its_exit_status(method):
    spawner = WorkerSpawner(method)
    env = dict(os.environ, **SIM_ENV)
    argv = ["--listen", f"unix:{socket_path('bad-' + method)}", "--config", "/nonexistent/sluice.toml"]
    process = await spawner.spawn(argv, env, "bad")
    try:
        assert await asyncio.wait_for(process.wait(), 60) == 2  # sluice worker: config error
    finally:
        spawner.close()


async def test_a_killed_worker_reports_the_signal():
    spawner = WorkerSpawner("forkserver")
    path = socket_path("killed")
    process = await spawner.spawn(["--listen", f"unix:{path}"], dict(os.environ, **SIM_ENV), "killed")
    try:
        deadline_s = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline_s:
            await asyncio.sleep(0.02)
        process.kill()
        assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGKILL
    finally:
        spawner.close()


def test_a_forked_worker_dies_with_a_gateway_that_is_killed():
    path = socket_path("orphan")
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(REPO)!r})
        from gateway.fleet.spawn import WorkerSpawner

        async def main():
            spawner = WorkerSpawner("forkserver")
            env = dict(os.environ, SLUICE_WORKER__BACKEND='"sim"')
            process = await spawner.spawn(["--listen", "unix:{path}"], env, "orphan")
            print(process.pid, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
    """)
    gateway = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        worker_pid = int(gateway.stdout.readline())
        deadline_s = time.monotonic() + 60
        while not os.path.exists(path):
            assert time.monotonic() < deadline_s, "the forked worker never listened"
            time.sleep(0.05)
        assert not process_gone(worker_pid)
        gateway.send_signal(signal.SIGKILL)
        gateway.wait(10)
        deadline_s = time.monotonic() + 30
        while not process_gone(worker_pid):
            assert time.monotonic() < deadline_s, f"worker {worker_pid} outlived its killed gateway"
            time.sleep(0.05)
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
        if os.path.exists(path):
            os.unlink(path)


def test_the_fork_server_imports_torch_only_for_pools_that_run_a_model():
    assert preload_modules(["sim", "sim"]) == list(PRELOAD_WORKER)
    assert "torch" not in preload_modules(["sim"])
    assert preload_modules(["sim", "cuda"]) == list(PRELOAD_WORKER) + list(PRELOAD_MODEL)
    assert "torch" in preload_modules(["auto"])


def test_an_unknown_start_method_is_refused_with_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="valid: forkserver, exec"):
        WorkerSpawner("vfork")
    config_path = tmp_path / "config.toml"
    config_path.write_text('[gateway]\nworker_start_method = "vfork"\n')
    with pytest.raises(ConfigError, match="worker_start_method"):
        load_config(config_path, environ={})
    config_path.write_text('[gateway]\nworker_start_method = "exec"\n')
    assert load_config(config_path, environ={}).gateway.worker_start_method == "exec"
