"""``sluice serve``: arguments, a gateway that connects to an already running worker instead of spawning, and what
its log says during a start (the ready line, the simulator warning, quiet polls)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import time
import urllib.request

import pytest

from gateway.__main__ import parse_args, ready_url
from gateway.http.middleware import request_log_level
from shared.logs import log_line_json
from tests.conftest import TEST_CONFIG
from tests.gateway.sim_gateway import sim_gateway
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


def test_ready_url_names_a_reachable_address():
    assert ready_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert ready_url("::", 8000) == "http://127.0.0.1:8000"
    assert ready_url("10.0.0.5", 9) == "http://10.0.0.5:9"
    assert ready_url("::1", 9) == "http://[::1]:9"


def test_request_log_levels():
    assert request_log_level("/favicon.ico", "unmatched", 404) is None
    assert request_log_level("/favicon.ico", "/favicon.ico", 204) is None
    for path in ("/healthz", "/health", "/readyz", "/metrics", "/status"):
        assert request_log_level(path, path, 200) == logging.DEBUG
    assert request_log_level("/readyz", "/readyz", 503) == logging.DEBUG
    assert request_log_level("/v1/models", "/v1/models", 200) == logging.INFO
    assert request_log_level("/nope", "unmatched", 404) == logging.INFO
    assert request_log_level("/", "/", 200) is None


def test_start_log_says_ready_at_the_url_warns_of_the_simulator_and_keeps_retries_and_polls_quiet(tmp_path):
    with sim_gateway(tmp_path) as server:
        base_url = server.base_url
        for path in ("/healthz", "/health", "/readyz", "/status", "/v1/models"):
            assert get_json(base_url + path, timeout_s=10)[0] == 200, path
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
            assert response.status == 200
        with urllib.request.urlopen(base_url + "/favicon.ico", timeout=10) as response:
            assert response.status == 204 and response.read() == b""
        deadline = time.monotonic() + 10
        # "ready at" is logged by a task that polls the fleet every READY_POLL_INTERVAL_S, so it may follow the
        # first answered request by up to that long: wait for both lines.
        while not (server.log_events("request") and server.log_events(f"ready at {base_url}")):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        ready = server.log_events(f"ready at {base_url}")
        assert len(ready) == 1 and ready[0]["url"] == base_url and ready[0]["level"] == "info", server.log_tail()
        warnings = server.log_events("simulator_backend")
        assert {"worker_id", "workers"} <= set().union(*warnings), warnings  # the worker's line and the gateway's
        assert all(w["level"] == "warning" and "SIMULATOR" in w["message"] for w in warnings), warnings
        assert server.log_events("worker_connect_retry") == []  # the local worker's cold start is not a failure
        paths = [event["path"] for event in server.log_events("request")]
        assert paths == ["/v1/models"], paths


def test_a_port_already_in_use_ends_serve_with_one_line_naming_it_before_any_worker_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = SluiceProcess(TEST_CONFIG, tmp_path, port=port, ready="none").start()
        try:
            assert server.process.wait(timeout=120) == 1
        finally:
            server.stop()
    log = server.log_text()
    assert log.strip() == f"sluice serve: 127.0.0.1:{port} is already in use (another sluice serve? choose another " \
                          "--port)", log
