"""The trace replayer: loopback guard, /status parsing, prompt sizing, and a real replay against sim workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.prompts import PromptBuilder, load_tokenizer
from loadtest.replay import ReplayError, build_texts, check_loopback, main, parse_status
from loadtest.traces import TraceRequest
from tests.conftest import REPO_ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1/", "http://[::1]:8000",
                                 "http://127.3.2.1:9"])
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "http://0.0.0.0:8000",
                                 "ftp://127.0.0.1/", "127.0.0.1:8000"])
def test_non_loopback_urls_are_refused(url):
    with pytest.raises(ReplayError):
        check_loopback(url)


def test_cli_refuses_a_remote_base_url_before_sending_anything(capsys):
    assert main(["azure-code", "--base-url", "http://192.0.2.7:8000", "--max-requests", "1"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_parse_status_reads_workers_and_admission_tiers():
    status = {"active_requests": 7,
              "admission": {"pressure": {"level": "elevated"},
                            "tiers": {"vip": {"queue_depth": 2}, "free": {"queue_depth": 5}}},
              "workers": [{"name": "local-0", "capacity": {"num_running": 3, "num_waiting": 1,
                                                           "used_kv_blocks": 25, "total_kv_blocks": 100}},
                          {"name": "local-1", "capacity": None}]}
    sample = parse_status(1.5, status)
    assert sample.active_requests == 7
    assert sample.queue_depth_by_tier == {"vip": 2, "free": 5}
    assert sample.pressure == "elevated"
    assert sample.running_by_worker == {"local-0": 3, "local-1": 0}
    assert sample.kv_used_fraction_by_worker["local-0"] == 0.25


def test_prompts_come_out_at_the_trace_length_in_served_tokens():
    tokenizer = load_tokenizer()
    builder = PromptBuilder(tokenizer)
    requests = [TraceRequest(0.0, n, 10) for n in (40, 700, 3000)] + [TraceRequest(0.0, 9000, 100)]
    texts, inputs, num_clipped = build_texts(requests, 8192, builder)
    assert num_clipped == 1 and inputs[3] == 8192 - 100 - 16
    for text, n in zip(texts, inputs):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert abs(len(ids) - n) <= max(3, 0.01 * n)
    assert len(set(texts)) == len(texts)


def test_replay_azure_code_against_sim_workers(sim_server, tmp_path):
    out = tmp_path / "replay.json"
    plots = tmp_path / "plots"
    cmd = [sys.executable, "-m", "sluice.cli", "replay", "azure-code", "--base-url", sim_server.base_url,
           "--rate-scale", "4", "--max-requests", "60", "--duration-s", "15", "--drain-timeout-s", "30",
           "--tier-mix", "vip=0.2,standard=0.6,free=0.2", "--slo-ttft-s", "vip=2,standard=10,free=10",
           "--json", str(out), "--plot-dir", str(plots)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:] + sim_server.log_tail()
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["all"]["count"] == 60
    assert {name: s["count"] for name, s in summary["tiers"].items()} == {"vip": 12, "standard": 36, "free": 12}
    requests = report["requests"]
    assert len(requests) == 60
    # the server's default tier is vip, so the header lowers each request to its own tier, and the gateway says so
    assert all(r["served_tier"] == r["tier"] for r in requests if r["outcome"] == "ok")
    assert "were served in tier" not in proc.stderr
    for r in requests:
        assert r["outcome"] == "ok" or (r["outcome"] == "http_error" and r["status"] in (429, 503)), r
        if r["outcome"] == "http_error":
            assert r["retry_after_s"] is not None and r["retry_after_s"] >= 1, r
    ok = [r for r in requests if r["outcome"] == "ok"]
    assert len(ok) >= 30, summary["all"]["outcomes"]
    for r in ok:
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert 0 < r["completion_tokens"] <= r["max_tokens"]
        assert abs(r["prompt_tokens"] - r["input_tokens"]) <= max(3, 0.01 * r["input_tokens"]), r
        if r["completion_tokens"] > 1:
            assert r["tpot_s"] > 0
    # ignore_eos: the simulator never samples EOS anyway, so every answer runs to its (possibly capped) budget
    assert sum(r["completion_tokens"] == r["max_tokens"] for r in ok) >= 0.9 * len(ok)
    for tier in summary["tiers"].values():
        assert tier["ttft_s"]["p50"] is not None and tier["ttft_s"]["p50"] <= tier["ttft_s"]["p99"]
        assert 0.0 <= tier["slo_attainment"] <= 1.0
        assert tier["goodput_per_s"] == pytest.approx(tier["slo_met"] / summary["window_s"])
    assert len(report["status_samples"]) >= 5
    assert any(sum(s["running_by_worker"].values()) > 0 for s in report["status_samples"])
    for name in ("replay_latency.png", "replay_queue.png"):
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


STANDARD_DEFAULT_CONFIG = """
[worker]
num_local_workers = 1
backend = "sim"

[sim]
time_scale = 2.0
"""


def test_replay_sized_to_capacity_on_the_default_config_replays_vip_as_standard_and_says_so(tmp_path):
    """The default config gives a request without a key tier 'standard': the replay's vip share is replayed as
    standard with one note up front (no warning after the table), and --capacity-scale calibrates a fresh
    gateway and offers half its measured capacity."""
    from tests.conftest import sluice_serve

    out = tmp_path / "replay.json"
    with sluice_serve(tmp_path, STANDARD_DEFAULT_CONFIG, 120.0) as server:
        cmd = [sys.executable, "-m", "sluice.cli", "replay", "azure-conv", "--base-url", server.base_url,
               "--capacity-scale", "0.5", "--max-requests", "12", "--duration-s", "120", "--drain-timeout-s", "60",
               "--json", str(out)]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after 4 calibration requests" in proc.stdout and "replaying at 0.5 × capacity" in proc.stdout
    assert "tier 'vip' is above what a request without an API key gets (the gateway serves it as 'standard')" in proc.stderr
    assert "were served in tier" not in proc.stderr
    report = json.loads(out.read_text())
    assert set(report["summary"]["tiers"]) == {"standard", "free"}
    assert all(r["served_tier"] == r["tier"] for r in report["requests"] if r["outcome"] == "ok")
    assert report["options"]["rate_scale"] > 0 and report["options"]["capacity_scale"] == 0.5


def test_replay_of_a_tier_the_gateway_does_not_have_stops_before_sending_the_trace(tmp_path):
    """A gateway with one tier answers a request in another with a 400: the replay says so in one line and exits 2
    instead of replaying requests that can only fail (it replayed them all as http_400 rows, without a word)."""
    from tests.conftest import sluice_serve

    config = 'default_tier = "standard"\n\n[[tiers]]\nname = "standard"\n' + STANDARD_DEFAULT_CONFIG
    out = tmp_path / "replay.json"
    with sluice_serve(tmp_path, config, 120.0) as server:
        cmd = [sys.executable, "-m", "sluice.cli", "replay", "azure-conv", "--base-url", server.base_url,
               "--rate-scale", "1", "--max-requests", "6", "--drain-timeout-s", "30", "--json", str(out)]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
        status = server.status()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "sluice replay: the gateway refused the probe of tier 'free' (400: " in proc.stderr, proc.stderr
    assert "--tier-mix" in proc.stderr and not out.exists()
    assert status["admission"]["tiers"]["standard"]["admitted"] == 1, status["admission"]["tiers"]  # its probe
