"""``sluice serve --worker-address``: a gateway that connects to an already running worker instead of spawning."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest

from gateway.__main__ import parse_args
from shared.logs import log_line_json
from tests.conftest import TEST_CONFIG
from tests.support.server import SluiceProcess, get_json

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


def test_gateway_serves_through_an_external_worker_and_leaves_it_running(tmp_path):
    worker = SluiceProcess(TEST_CONFIG, tmp_path / "worker", command="worker", ready="none").start()
    gateway = SluiceProcess(TEST_CONFIG, tmp_path / "gateway", args=["--worker-address", f"127.0.0.1:{worker.port}"],
                            ready="readyz", min_ready_workers=0)
    worker_port, base_url = worker.port, gateway.base_url
    try:
        gateway.start()
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 4}).encode()
        request = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] <= 4
        status = get_json(base_url + "/status")[1]
        assert status["local_workers"] == [] and status["workers"][0]["address"] == f"127.0.0.1:{worker_port}"
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(timeout=30) == 0
        time.sleep(0.5)
        assert worker.process.poll() is None  # not ours to stop
    finally:
        gateway.close()
        worker.close()
