"""Helpers of the job tests: start / kill -9 / restart a real ``sluice serve`` with its own config, and HTTP calls.

Each test module starts its own servers (its own ``[jobs]`` store), unlike the session-wide ``sluice_server``
fixture of tests/conftest.py, because these tests kill and restart gateways and workers.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.server import REPO_ROOT, SluiceProcess, free_port  # noqa: F401

FIXTURES = REPO_ROOT / "tests" / "fixtures"
MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 300.0
REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_available() -> bool:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError:
        return False
    return True


def delete_redis_prefix(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=prefix + ":*", count=1000):
        client.delete(key)
    client.close()


def http(method: str, url: str, body: dict | None = None, headers: dict[str, str] | None = None,
         timeout_s: float = 60.0) -> tuple[int, dict, dict]:
    """Send a JSON request; return (status, lower-cased headers, decoded JSON body or {})."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw, resp_headers = response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        status, raw, resp_headers = exc.code, exc.read(), exc.headers
    parsed = json.loads(raw) if raw else {}
    return status, {k.lower(): v for k, v in resp_headers.items()}, parsed


def chat_body(content: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def mt_bench_prompts() -> list[str]:
    """The first-turn MT-Bench prompts kept under tests/fixtures (a copy of ../shared/data/mt_bench)."""
    return [p["prompt"] for p in json.loads((FIXTURES / "mt_bench_prompts.json").read_text())]


def batch_lines(num_lines: int, max_tokens: int = 8, prefix: str = "r") -> bytes:
    """Return a batch input file of ``num_lines`` chat requests (custom_id ``r1``…) from tests/fixtures."""
    rows = [json.loads(line) for line in (FIXTURES / "batch_mt_bench_64.jsonl").read_text().splitlines() if line]
    lines = []
    for i in range(num_lines):
        row = rows[i % len(rows)]
        row = {**row, "custom_id": f"{prefix}{i + 1}", "body": {**row["body"], "max_tokens": max_tokens}}
        lines.append(json.dumps(row))
    return ("\n".join(lines) + "\n").encode()


class Server(SluiceProcess):
    """One ``sluice serve`` process with its config, port and log; restartable on the same config and port; with
    the JSON calls of the job tests."""

    def __init__(self, workdir: Path, config_text: str, env: dict[str, str] | None = None) -> None:
        super().__init__(config_text, workdir, env=env, start_timeout_s=START_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM the gateway (SIGKILL after 30 s), then SIGKILL whatever of its process group is left."""
        super().stop(kill_group=True)

    def status(self) -> dict:
        return http("GET", self.base_url + "/status")[2]

    def get(self, path: str, key: str | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        status, _, body = http("GET", self.base_url + path, headers=headers)
        return status, body

    def post(self, path: str, body: dict, key: str | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
        all_headers = {"Authorization": f"Bearer {key}"} if key else {}
        all_headers.update(headers or {})
        return http("POST", self.base_url + path, body, all_headers)

    def delete(self, path: str, key: str | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        status, _, body = http("DELETE", self.base_url + path, headers=headers)
        return status, body

    def wait_job(self, job_id: str, key: str | None, until: set[str], timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            status, job = self.get(f"/v1/jobs/{job_id}", key)
            if status == 200 and job["status"] in until:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {until} after {timeout_s} s: {job}\n{self.log_tail()}")
            time.sleep(0.1)


def sim_config(jobs: str, max_num_seqs: int = 8, time_scale: float = 1.0, extra: str = "") -> str:
    """A config with one local sim worker (the roofline simulator: fast, deterministic timing)."""
    return f"""
[model]
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 256
default_max_tokens = 16

[worker]
num_local_workers = 1
backend = "sim"
max_num_seqs = {max_num_seqs}
capacity_interval_s = 0.05

[sim]
time_scale = {time_scale}

[jobs]
{jobs}
{extra}
"""


def sqlite_jobs(path: Path, lease_timeout_s: float = 2.0) -> str:
    return f'store = "sqlite"\nsqlite_path = "{path}"\nlease_timeout_s = {lease_timeout_s}\npoll_interval_s = 0.05\n'


def redis_jobs(prefix: str, lease_timeout_s: float = 2.0) -> str:
    return (f'store = "redis"\nredis_url = "{REDIS_URL}"\nredis_key_prefix = "{prefix}"\n'
            f'lease_timeout_s = {lease_timeout_s}\npoll_interval_s = 0.05\n')
