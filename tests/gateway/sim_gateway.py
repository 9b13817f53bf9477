"""A real ``sluice serve`` with one local **sim** worker (the roofline simulator), for tests of the operational
surface (status page, Grafana dashboard) that need live ``/status`` and ``/metrics`` but no model forward pass.

Each test module starts its own (module-scoped fixture); the process handling and the shutdown check (no worker
outlives the gateway) are those of ``tests/conftest.py``'s session server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SluiceServer, _alive, _child_pids, _free_port, get_json

SIM_SERVER_START_TIMEOUT_S = 180.0
MODEL_NAME = "SmolLM2-135M-Instruct"

# A small simulated KV pool (0.25 GiB at 128 KiB per token = 128 blocks of 16 tokens) and 4 running sequences at
# most, so a handful of concurrent clients fills the KV pool, queues in admission and, in the ``free`` tier (queue
# of 1, 30 requests per minute), gets rejected.
SIM_GATEWAY_CONFIG = f"""
[model]
name = "{MODEL_NAME}"

[gateway]
max_tokens_cap = 256
default_max_tokens = 64

[worker]
num_local_workers = 1
backend = "sim"
max_num_seqs = 4
capacity_interval_s = 0.25

[sim]
kv_cache_gib = 0.25

[[tiers]]
name = "vip"
priority = 3
queue_capacity = 64
queue_timeout_s = 30.0

[[tiers]]
name = "standard"
priority = 2
queue_capacity = 64
queue_timeout_s = 30.0

[[tiers]]
name = "free"
priority = 1
queue_capacity = 1
queue_timeout_s = 30.0
rpm_limit = 30

[[tiers]]
name = "batch"
priority = 0
queue_capacity = 64
queue_timeout_s = 60.0
"""


@contextlib.contextmanager
def sim_gateway(workdir: Path, config_text: str = SIM_GATEWAY_CONFIG) -> Iterator[SluiceServer]:
    """Run ``sluice serve`` with ``config_text`` on a free loopback port until the block exits.

    Args:
        workdir: where the config file and the server log go.
        config_text: the TOML config (``SLUICE_*`` variables of the caller's environment are dropped).

    Yields:
        The running server, ready (``/readyz`` answered 200).
    """
    config_path = workdir / "config.toml"
    config_path.write_text(config_text)
    log_path = workdir / "serve.log"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "serve", "--config", str(config_path), "--port", str(port)],
            cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    server = SluiceServer(f"http://127.0.0.1:{port}", process, log_path, tomllib.loads(config_text))
    try:
        deadline = time.monotonic() + SIM_SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"sluice serve exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if get_json(server.base_url + "/readyz", timeout_s=2.0)[0] == 200:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"sluice serve not ready after {SIM_SERVER_START_TIMEOUT_S} s:\n{server.log_tail()}")
            time.sleep(0.3)
        yield server
    finally:
        worker_pids = _child_pids(process.pid)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        time.sleep(0.5)
        survivors = [pid for pid in worker_pids if _alive(pid)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        assert not survivors, f"worker processes outlived the gateway: {survivors}"
