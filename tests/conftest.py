"""Shared fixtures: the served model's tokenizer, and a real ``sluice serve`` process (gateway + worker).

``sluice_server`` starts ``python -m sluice.cli serve`` on a free port with a small test config, waits for
``/readyz`` and yields its base URL. At teardown it checks, through ``/status``, that the worker's used KV blocks
went back to zero (nothing leaked by any test), then stops the server with SIGTERM and checks no worker survived.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import REPO_ROOT, ProcessExited, SluiceProcess, free_port, get_json  # noqa: F401
SERVER_START_TIMEOUT_S = 600.0
# Seconds the helpers of a stopped gateway (its fork server, multiprocessing's resource tracker) may take to exit:
# the fork server leaves once the gateway and its last worker are gone, after an interpreter shutdown that can
# take a second with torch imported on a busy machine.
HELPER_EXIT_TIMEOUT_S = 10.0
KV_RELEASE_TIMEOUT_S = 15.0

# The default weights mode (auto: int4 for the default Q4_1 file): the end-to-end tests compare answers across
# requests (a seeded request streamed and not, after the first one cached the prompt), which the quantized modes
# give token for token (tests/worker/test_model_quant.py).
TEST_CONFIG = """
[model]
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 192
default_max_tokens = 24
first_token_timeout_s = 300.0
stall_timeout_s = 120.0

[worker]
num_local_workers = 1
backend = "cpu"
kv_cache_gib = 0.25
max_num_seqs = 16
max_num_batched_tokens = 512
num_threads = 2
"""


REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_prefix(request):
    """A fresh key prefix in the real Redis at 127.0.0.1:6379 (``make redis`` starts it); every key under it is
    deleted afterwards. Skips the test when Redis is not running."""
    import uuid

    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        client.close()
        pytest.skip("no Redis at 127.0.0.1:6379 (run `make redis`)")
    prefix = f"test-{request.node.module.__name__.rsplit('.', 1)[-1]}-{uuid.uuid4().hex[:8]}"
    yield prefix
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="session")
def tokenizer():
    """The gateway's :class:`Tokenizer` of the default model (SmolLM2-135M-Instruct)."""
    from gateway.pipeline.tokenize import Tokenizer
    from shared.config import default_model_path

    tok = Tokenizer.from_model_path(default_model_path(), num_threads=1)
    yield tok
    tok.close()


class SluiceServer(SluiceProcess):
    """A running ``sluice serve`` of the test suite: :class:`SluiceProcess` plus the parsed config and the first
    worker's capacity."""

    def __init__(self, workdir: Path, config_text: str, **kwargs) -> None:
        import tomllib

        super().__init__(config_text, workdir, **kwargs)
        self.config = tomllib.loads(config_text)

    def worker_capacity(self) -> dict:
        """The first worker's last Capacity report (from ``/status``)."""
        return self.status()["workers"][0]["capacity"]

    def wait_for_capacity(self, predicate, timeout_s: float) -> dict:
        """Poll ``/status`` until ``predicate(capacity)`` holds; return that capacity (or the last one)."""
        deadline = time.monotonic() + timeout_s
        capacity = self.worker_capacity()
        while not predicate(capacity) and time.monotonic() < deadline:
            time.sleep(0.1)
            capacity = self.worker_capacity()
        return capacity


@contextlib.contextmanager
def sluice_serve(workdir: Path, config_text: str, start_timeout_s: float = SERVER_START_TIMEOUT_S,
                 poll_interval_s: float = 0.5, min_ready_workers: int = 1) -> Iterator[SluiceServer]:
    """Run ``python -m sluice.cli serve`` with ``config_text`` on a free loopback port until the block exits.

    Ready means ``/readyz`` answered 200 with at least ``min_ready_workers`` ready workers.

    The config file and the server log go to ``workdir``; ``SLUICE_*`` variables of the caller's environment are
    dropped. At exit the server is stopped with SIGTERM (SIGKILL after 30 s) and no worker process may outlive it;
    the helpers it started (the fork server its workers fork from, multiprocessing's resource tracker) must exit
    within :data:`HELPER_EXIT_TIMEOUT_S` of it.

    Yields:
        The running server, ready (``/readyz`` answered 200).
    """
    server = SluiceServer(workdir, config_text, min_ready_workers=min_ready_workers)
    try:
        server.start(wait=False)
        try:
            server.wait_ready(start_timeout_s, poll_interval_s)
        except ProcessExited as exc:
            pytest.fail(str(exc))
        yield server
    finally:
        if server.process is not None:
            _stop_checking_survivors(server)


def _stop_checking_survivors(server: SluiceServer) -> None:
    """Stop ``server``; fail when a worker outlives it or another helper outlives it by HELPER_EXIT_TIMEOUT_S."""
    process = server.process
    descendant_pids = _child_pids(process.pid)
    try:
        worker_pids = [w["pid"] for w in server.status()["local_workers"] if w.get("pid")]
    except (OSError, ValueError, KeyError, AssertionError):
        worker_pids = descendant_pids  # no status: hold every descendant to the workers' bound
    server.stop()
    time.sleep(0.5)
    survivors = [pid for pid in worker_pids if _alive(pid)]
    deadline_s = time.monotonic() + HELPER_EXIT_TIMEOUT_S
    while any(_alive(pid) for pid in descendant_pids) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    lingering = [pid for pid in descendant_pids if _alive(pid)]
    for pid in set(survivors + lingering):
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"worker processes outlived the gateway: {survivors}"
    assert not lingering, f"processes of the gateway outlived it by {HELPER_EXIT_TIMEOUT_S} s: {lingering}"


@pytest.fixture(scope="session")
def sluice_server(tmp_path_factory) -> Iterator[SluiceServer]:
    """A real gateway + local CPU worker on a free loopback port, for the whole session."""
    with sluice_serve(tmp_path_factory.mktemp("sluice_server"), TEST_CONFIG) as server:
        yield server
        # acceptance 6: after every test, no KV block is still held by a sequence
        capacity = server.wait_for_capacity(
            lambda c: c is not None and c["used_kv_blocks"] == 0 and c["num_running"] == 0
            and c["num_waiting"] == 0, KV_RELEASE_TIMEOUT_S)
        assert capacity["used_kv_blocks"] == 0, f"KV blocks leaked: {capacity}"
        assert capacity["num_running"] == 0 and capacity["num_waiting"] == 0, capacity


def _child_pids(pid: int) -> list[int]:
    """Return every descendant of ``pid``: the local workers are the fork server's children (gateway/fleet/spawn.py)."""
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    children = [int(p) for p in out.split()]
    return children + [grandchild for child in children for grandchild in _child_pids(child)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
