"""Start a real ``sluice serve`` with sim (roofline SIMULATOR) workers for benches, and replay traces against it.

Used by ``bench/replay_bench.py`` and ``bench/plan_check.py``: one gateway process per configuration on a free
loopback port, stopped with SIGTERM (then SIGKILL of its process group) when the ``with`` block ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.replay import ReplayOptions, ReplayRun, run_replay
from loadtest.traces import TraceRequest

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """Return a free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    """GET ``url``; return (status, JSON body or None)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


class SimGateway:
    """``sluice serve`` with ``num_workers`` sim workers, as a context manager.

    Args:
        num_workers: local sim workers.
        config_text: TOML written to a temporary config file (``[worker]`` backend/count are forced by env).
        env: extra ``SLUICE_*`` overrides (e.g. ``{"SLUICE_ADMISSION__ENABLED": "false"}``).
        start_timeout_s: how long to wait for every worker to be ready.
        log_path: where the gateway's log goes (default: a temporary file).
    """

    def __init__(self, num_workers: int, config_text: str = "", env: dict[str, str] | None = None,
                 start_timeout_s: float = 180.0, log_path: str | Path | None = None) -> None:
        self.num_workers = num_workers
        self.config_text = config_text
        self.extra_env = env or {}
        self.start_timeout_s = start_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="sluice-bench-")
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / "serve.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> SimGateway:
        config_path = Path(self._tmp.name) / "config.toml"
        config_path.write_text(self.config_text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        env.update({"SLUICE_GATEWAY__PORT": str(self.port), "SLUICE_WORKER__BACKEND": "sim",
                    "SLUICE_WORKER__NUM_LOCAL_WORKERS": str(self.num_workers)})
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--config",
                                             str(config_path)], cwd=REPO_ROOT, env=env, stdout=log_file,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.process.returncode}: {self.log_tail()}")
            try:
                status, body = get_json(self.base_url + "/readyz", timeout_s=2.0)
                if status == 200 and body and body.get("ready_workers") == self.num_workers:
                    return self
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"sluice serve not ready after {self.start_timeout_s} s: {self.log_tail()}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._tmp.cleanup()

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until the gateway serves no request and no worker runs or queues one; True if it got there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = get_json(self.base_url + "/status")
            if status == 200 and body and not body.get("active_requests") and all(
                    not (w.get("capacity") or {}).get("num_running") and not (w.get("capacity") or {}).get(
                        "num_waiting") for w in body.get("workers") or []):
                return True
            time.sleep(0.5)
        return False


def replay(gateway: SimGateway, requests: list[TraceRequest], slo_ttft_s_by_tier: dict[str, float],
           prompt_builder, prompt_salt: int, drain_timeout_s: float = 30.0) -> ReplayRun:
    """Replay ``requests`` against ``gateway`` (blocking); wait for it to be idle before and after."""
    gateway.wait_idle()
    opts = ReplayOptions(base_url=gateway.base_url, slo_ttft_s_by_tier=slo_ttft_s_by_tier,
                         drain_timeout_s=drain_timeout_s, prompt_salt=prompt_salt)
    run = asyncio.run(run_replay(requests, opts, prompt_builder))
    gateway.wait_idle()
    return run
