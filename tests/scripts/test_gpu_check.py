"""``scripts/gpu_check.sh --dry-run``: every stage of the GPU check runs here, in a venv shaped like the lent GPU
machine, with its GPU work replaced by a "skipped: no GPU" result; a missing package, a wrong path or a syntax
error fails it. ``make test`` builds the venv first (``--prepare-dry-run``, cached under var/gpu-dry-run/)."""

from __future__ import annotations

import json
import subprocess

from tests.support.server import REPO_ROOT, clean_env

# the venv is built here only when `make test` did not build it first (minutes: torch from the local index)
DRY_RUN_TIMEOUT_S = 900


def test_the_gpu_check_dry_run_passes_every_stage(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=DRY_RUN_TIMEOUT_S, env=clean_env({"OUT": str(tmp_path)}))
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry_run"] is True and summary["failed_stages"] == 0
    assert [s["stage"] for s in summary["stages"]] == ["imports", "kernel_compile", "kernel_tests", "kernel_bench",
                                                       "engine_bench", "gateway_e2e"]
    for name in ("kernel_compile", "kernel_bench", "engine_bench", "gpu_e2e"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["skipped"].startswith("no GPU")
    assert "tests collected" in (tmp_path / "kernel_tests.log").read_text()
