"""``/readyz`` names why a pool has no ready worker when its local worker fails to start (it said "no worker
configured" while the worker crash-looped)."""

from __future__ import annotations

import time

from tests.support.server import SluiceProcess, get_json

# The pool's worker gets an override its own config load refuses (max_num_seqs must be >= 1): it exits with
# status 2 before it says Hello, every time the gateway starts it.
CRASHING_WORKER_CONFIG = """
[worker]
backend = "sim"

[[pools]]
name = "default"
backend = "sim"
min_workers = 1
max_workers = 1
env = { SLUICE_WORKER__MAX_NUM_SEQS = "0" }
"""


def test_readyz_names_the_local_worker_that_exits_before_it_is_ready():
    server = SluiceProcess(CRASHING_WORKER_CONFIG, ready="healthz").start()
    try:
        deadline_s = time.monotonic() + 60
        while True:
            status, body = get_json(server.base_url + "/readyz")
            assert status == 503, body
            message = body["error"]["message"]
            if "exited with status" in message or time.monotonic() > deadline_s:
                break
            time.sleep(0.2)
        assert "pool default: local worker" in message and "exited with status 2 before it was ready" in message, (
            message, server.log_tail())
    finally:
        server.stop()
