"""Start a real ``sluice serve`` with sim (roofline SIMULATOR) workers for benches, and replay traces against it.

Used by ``bench/replay_bench.py`` and ``bench/plan_check.py``: one gateway process per configuration on a free
loopback port, stopped with SIGTERM (then SIGKILL of its process group) when the ``with`` block ends.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loadtest.replay import ReplayOptions, ReplayRun, run_replay
from loadtest.traces import TraceRequest
from tests.support.server import SluiceProcess, free_port, get_json  # noqa: F401


class SimGateway(SluiceProcess):
    """``sluice serve`` with ``num_workers`` sim workers, as a context manager.

    Args:
        num_workers: local sim workers.
        config_text: TOML written to a temporary config file (``[worker]`` backend/count are forced by env).
        env: extra ``SLUICE_*`` overrides (e.g. ``{"SLUICE_ADMISSION__ENABLED": "false"}``).
        start_timeout_s: how long to wait for every worker to be ready.
        log_path: where the gateway's log goes (default: a temporary file).
    """

    def __init__(self, num_workers: int, config_text: str = "", env: dict[str, str] | None = None,
                 start_timeout_s: float = 180.0, log_path: str | Path | None = None) -> None:
        forced = {"SLUICE_WORKER__BACKEND": "sim", "SLUICE_WORKER__NUM_LOCAL_WORKERS": str(num_workers)}
        super().__init__(config_text, env={**forced, **(env or {})}, min_ready_workers=num_workers,
                         start_timeout_s=start_timeout_s, log_path=Path(log_path) if log_path else None)
        self.num_workers = num_workers

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until the gateway serves no request and no worker runs or queues one; True if it got there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = get_json(self.base_url + "/status")
            if status == 200 and body and not body.get("active_requests") and all(
                    not (w.get("capacity") or {}).get("num_running") and not (w.get("capacity") or {}).get(
                        "num_waiting") for w in body.get("workers") or []):
                return True
            time.sleep(0.5)
        return False


def replay(gateway: SimGateway, requests: list[TraceRequest], slo_ttft_s_by_tier: dict[str, float],
           prompt_builder, prompt_salt: int, drain_timeout_s: float = 30.0) -> ReplayRun:
    """Replay ``requests`` against ``gateway`` (blocking); wait for it to be idle before and after."""
    gateway.wait_idle()
    opts = ReplayOptions(base_url=gateway.base_url, slo_ttft_s_by_tier=slo_ttft_s_by_tier,
                         drain_timeout_s=drain_timeout_s, prompt_salt=prompt_salt)
    run = asyncio.run(run_replay(requests, opts, prompt_builder))
    gateway.wait_idle()
    return run
