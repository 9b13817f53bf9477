"""A local worker that stops on its configuration (exit status 2 before Hello) is not restarted: ``sluice serve``
exits with the worker's reason when no pool can serve, and reports the broken pool (``/readyz``, ``/status``) while
another serves. (It said "no worker configured" while the worker crash-looped, then restarted it forever.) A pool
scaled to zero whose first worker, started for a request, stops so does not end the gateway: the request gets a 503
naming the error. (The gateway exited 2 with that request open: the client read an empty reply.)"""

from __future__ import annotations

import time

from tests.support.server import SluiceProcess, get_json, post_json

# The pool's worker gets an override its own config load refuses (a block longer than the context): it exits with
# status 2 before it says Hello.
BROKEN_POOL = """
[[pools]]
name = "{name}"
model_name = "{name}-model"
backend = "sim"
min_workers = 1
max_workers = 1
env = {{ SLUICE_WORKER__BLOCK_SIZE_TOKENS = "100000" }}
"""
WORKING_POOL = """
[[pools]]
name = "default"
backend = "sim"
min_workers = 1
max_workers = 1
"""
SIM = '[worker]\nbackend = "sim"\n'


def test_serve_exits_with_the_workers_reason_when_no_pool_can_serve():
    server = SluiceProcess(SIM + BROKEN_POOL.format(name="only"), ready="none").start()
    try:
        returncode = server.process.wait(timeout=120)
        log = server.log_text()
        assert returncode == 2, log
        assert ("sluice serve: no pool can serve: pool only: worker.block_size_tokens = 100000 exceeds "
                "model.max_model_len_tokens = 8192") in log, log
        assert log.count("local_worker_config_error") == 1 and "local_worker_spawn_backoff" not in log, log
    finally:
        server.stop()
        server.close()


def test_readyz_and_status_name_a_broken_pool_while_another_serves():
    server = SluiceProcess(SIM + WORKING_POOL + BROKEN_POOL.format(name="broken"), ready="readyz").start()
    try:
        deadline_s = time.monotonic() + 60
        while True:
            status, body = get_json(server.base_url + "/readyz")
            if "pool_config_errors" in body or time.monotonic() > deadline_s:
                break
            time.sleep(0.2)
        assert status == 200, body
        assert body["pool_config_errors"]["broken"].startswith("worker.block_size_tokens = 100000 exceeds"), body
        pools = server.status()["fleet"]["pools"]
        assert pools["broken"]["config_error"] == body["pool_config_errors"]["broken"]
        assert pools["default"]["config_error"] is None
        assert server.log_text().count("local_worker_config_error") == 1
    finally:
        server.stop()
        server.close()


def _chat(base_url: str) -> tuple[int, dict, dict[str, str]]:
    return post_json(base_url + "/v1/chat/completions", {
        "model": "only-model", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})


def test_a_pool_scaled_to_zero_whose_first_worker_fails_its_config_answers_503_and_the_gateway_serves_on():
    config = SIM + "[autoscale]\ninterval_s = 0.25\n" + BROKEN_POOL.format(name="only").replace(
        "min_workers = 1", "min_workers = 0")
    server = SluiceProcess(config, ready="readyz", min_ready_workers=0).start()  # ready at once: it scales from 0
    reason = "worker.block_size_tokens = 100000 exceeds model.max_model_len_tokens = 8192"
    try:
        # the first starts the pool's first worker, which exits 2: it waited for that cold start, and is told why
        # it will not come (it waited out its queue deadline, then read "the server is overloaded"); the next at once
        for _ in range(2):
            status, body, headers = _chat(server.base_url)
            assert (status, body["error"]["code"]) == (503, "no_worker_available"), body
            assert reason in body["error"]["message"] and int(headers["Retry-After"]) >= 1, (body, headers)
        assert server.process.poll() is None, server.log_text()
        status, body = get_json(server.base_url + "/readyz")
        assert status == 503 and reason in body["error"]["message"], body
        assert server.status()["fleet"]["pools"]["only"]["config_error"].startswith(reason)
        log = server.log_text()
        assert "gateway_cannot_serve" not in log and log.count("local_worker_config_error") == 1, log
    finally:
        server.stop()
        server.close()
