"""Helpers shared by the benchmarks: start a real ``sluice serve``, read prompts, percentiles."""

from __future__ import annotations

import contextlib
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

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mt_bench_prompts(limit: int) -> list[str]:
    """First-turn MT-Bench prompts (../shared/data), falling back to the test fixture copy."""
    path = SHARED_DATA / "mt_bench" / "question.jsonl"
    if path.exists():
        prompts = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = [p["prompt"] for p in json.loads((REPO_ROOT / "tests/fixtures/mt_bench_prompts.json").read_text())]
    return [prompts[i % len(prompts)] for i in range(limit)]


@contextlib.contextmanager
def sluice_server(config_text: str, env: dict[str, str] | None = None, start_timeout_s: float = 600.0):
    """Run ``sluice serve`` with ``config_text`` on a free port; yield its base URL; stop it afterwards."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.toml"
        config_path.write_text(config_text)
        log_path = Path(tmp) / "serve.log"
        full_env = {**os.environ, **(env or {}), "SLUICE_GATEWAY__PORT": str(port)}
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.cli", "serve", "--config", str(config_path)],
                cwd=REPO_ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"sluice serve exited: {log_path.read_text()[-3000:]}")
                try:
                    with urllib.request.urlopen(base_url + "/readyz", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("sluice serve did not become ready")
                time.sleep(0.5)
            yield base_url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def write_result(name: str, result: dict) -> Path:
    """Write ``result`` as JSON to bench/results/<name>.json and print it."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return path
