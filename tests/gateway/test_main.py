"""``sluice serve --worker-address``: a gateway that connects to an already running worker instead of spawning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from gateway.__main__ import log_line_json, parse_args
from tests.conftest import REPO_ROOT, TEST_CONFIG, _free_port, get_json

pytestmark = pytest.mark.slow


def test_parse_args_repeatable_worker_address():
    args = parse_args(["--port", "9", "--worker-address", "127.0.0.1:1", "--worker-address", "unix:/tmp/x.sock"])
    assert args.port == 9 and args.worker_address == ["127.0.0.1:1", "unix:/tmp/x.sock"]


def test_log_lines_are_json_objects_with_a_repr_for_other_values():
    marker = object()
    line = log_line_json({"event": "request", "status": 200, "ttft_ms": 1.5, "tenant": "ünï", "ids": (1, 2),
                          "by_gen": {0: 1}, "obj": marker, "none": None})
    assert "\n" not in line
    assert json.loads(line) == {"event": "request", "status": 200, "ttft_ms": 1.5, "tenant": "ünï", "ids": [1, 2],
                                "by_gen": {"0": 1}, "obj": repr(marker), "none": None}


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "gateway exited"
        try:
            if get_json(url + "/readyz", timeout_s=2.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail("gateway not ready")


def test_gateway_serves_through_an_external_worker_and_leaves_it_running(tmp_path):
    config_path = tmp_path / "config.toml"
    config_path.write_text(TEST_CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    worker_port, gateway_port = _free_port(), _free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "worker", "--listen", f"127.0.0.1:{worker_port}",
         "--config", str(config_path)], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "serve", "--config", str(config_path), "--port", str(gateway_port),
         "--worker-address", f"127.0.0.1:{worker_port}"], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{gateway_port}"
    try:
        _wait_ready(base_url, gateway)
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 4}).encode()
        request = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] <= 4
        status = get_json(base_url + "/status")[1]
        assert status["local_workers"] == [] and status["workers"][0]["address"] == f"127.0.0.1:{worker_port}"
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0
        time.sleep(0.5)
        assert worker.poll() is None  # not ours to stop
    finally:
        for process in (gateway, worker):
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
