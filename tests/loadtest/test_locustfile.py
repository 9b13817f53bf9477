"""Locust headless for 20 s against a gateway with sim workers; its CSV shows requests, no failures, TTFT."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

LOCUST = Path(sys.executable).parent / "locust"


@pytest.mark.skipif(not LOCUST.exists() and shutil.which("locust") is None, reason="locust not installed "
                    "(pip install -e '.[loadtest]')")
def test_locust_headless_streams_with_ttft_and_no_failures(sim_server, tmp_path):
    prefix = tmp_path / "locust"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["SLUICE_LOCUST_MAX_TOKENS"] = "32"
    cmd = [str(LOCUST if LOCUST.exists() else shutil.which("locust")), "-f", "loadtest/locustfile.py",
           "--headless", "-u", "4", "-r", "4", "-t", "20s", "--csv", str(prefix), "--host", sim_server.base_url,
           "--only-summary"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as file:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(file)}
    total = rows[("", "Aggregated")]
    assert int(total["Request Count"]) > 20
    assert int(total["Failure Count"]) == 0, proc.stderr[-3000:]
    ttft = rows[("SSE", "TTFT")]
    assert int(ttft["Request Count"]) > 10
    assert 0 < float(ttft["Median Response Time"]) < 5000
    assert int(rows[("SSE", "TPOT")]["Request Count"]) > 10
    assert int(rows[("POST", "chat (mt-bench turn 2)")]["Request Count"]) >= 1
    assert ("POST", "/v1/jobs (submit)") not in rows  # job users have weight 0 without SLUICE_LOCUST_JOBS=1
