"""A real ``sluice serve`` with two sim (roofline SIMULATOR) workers, for the load-test end-to-end tests.

The default tier is the top one (``vip``) so that the replayer and locust can pick any tier with the
``x-sluice-tier`` header (which only lowers). ``sim.time_scale = 2`` makes the simulated H200 twice slower so
queues form at request rates this 2-core machine can drive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import _free_port, get_json

REPO_ROOT = Path(__file__).resolve().parents[2]
SIM_CONFIG = """
default_tier = "vip"

[worker]
num_local_workers = 2
backend = "sim"

[sim]
time_scale = 2.0
"""
START_TIMEOUT_S = 120.0


@dataclass
class SimServer:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory) -> SimServer:
    workdir = tmp_path_factory.mktemp("sim_server")
    config_path = workdir / "config.toml"
    config_path.write_text(SIM_CONFIG)
    log_path = workdir / "serve.log"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["SLUICE_GATEWAY__PORT"] = str(port)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--config", str(config_path)],
                                   cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = SimServer(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"sluice serve exited with {process.returncode}:\n{server.log_tail()}")
        try:
            status, body = get_json(server.base_url + "/readyz", timeout_s=2.0)
            if status == 200 and body.get("ready_workers") == 2:
                break
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"sluice serve (sim) not ready after {START_TIMEOUT_S} s:\n{server.log_tail()}")
        time.sleep(0.5)
    try:
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
