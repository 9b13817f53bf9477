"""A choice's first-token deadline (gateway/pipeline/choice.py) against a real ``sluice serve`` gateway.

The only worker is a test double that speaks the real protocol (Hello, Capacity, Pong) and never answers a
``Generate`` (tests/gateway/fake_worker.py): it pins the gateway's retry decision, which a real worker cannot be made
to exercise on command.
"""

from __future__ import annotations

import pytest

from tests.gateway.fake_worker import FakeWorker, FakeWorkers
from tests.support.server import SluiceProcess, post_json

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FIRST_TOKEN_TIMEOUT_S = 1.0
SILENT_WORKER_CONFIG = f"""
[model]
max_model_len_tokens = 2048

[gateway]
first_token_timeout_s = {FIRST_TOKEN_TIMEOUT_S}
stall_timeout_s = {FIRST_TOKEN_TIMEOUT_S}

[breaker]
failure_threshold = 10   # the silent worker stays routable for every request of the test
"""


def test_first_token_timeout_bounds_the_whole_choice_not_each_attempt_on_the_same_worker(tmp_path):
    silent = FakeWorker("silent", 10_000)
    with FakeWorkers([silent]):
        with SluiceProcess(SILENT_WORKER_CONFIG, tmp_path, args=["--worker-address", f"127.0.0.1:{silent.port}"],
                           start_timeout_s=300) as gateway:
            for stream in (False, True):
                status, body, _ = post_json(gateway.base_url + "/v1/completions",
                                            {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream})
                assert status == 504 and body["error"]["code"] == "worker_timeout", body
                assert f"within {FIRST_TOKEN_TIMEOUT_S:g} s" in body["error"]["message"]
    # one Generate per request, each aborted at the deadline: the timeout spent the whole first-token budget, so
    # the only worker, which just timed out, is not sent the same request again
    assert len(silent.generates) == 2 and sorted(silent.aborts) == sorted(silent.generates), silent
