"""The capacity planner on hand-computed cases (sluice/plan.py)."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from shared.config import SimConfig, WorkerConfig
from sluice.plan import (
    WorkerModel,
    _own_prefill_s,
    allen_cunneen_wait_s,
    erlang_c,
    format_plan,
    main,
    measured_worker_model,
    mmc_mean_wait_s,
    plan,
    predict,
    priority_waits_s,
    service_profile,
    simulate_waits,
    workload_from_rate,
)
from worker.backends.sim import GIB

# A round-number GPU: 1 TB/s at 100% efficiency, 1 B params in 2-byte weights (2 ms to read) + 2 ms overhead
# = 4 ms per step; 1 byte of KV per token (1 ps per token read); prefill 2 × 1e9 FLOPs per token at 1000 TFLOP/s.
ROUND_SIM = SimConfig(hbm_bandwidth_gb_s=1000.0, hbm_efficiency=1.0, usable_tflops=1000.0, model_params_b=1.0,
                      weight_bytes_per_param=2.0, kv_bytes_per_token=1, kv_cache_gib=1.0, step_overhead_ms=2.0)


def test_step_costs_come_from_the_sim_roofline():
    model = WorkerModel.from_roofline(ROUND_SIM, WorkerConfig())
    assert model.step_s == pytest.approx(0.004)
    assert model.prefill_token_s == pytest.approx(2e9 / 1e15)
    assert model.kv_token_s == pytest.approx(1e-12, rel=1e-3)  # 1 byte / 1e12 B/s
    scaled = WorkerModel.from_roofline(msgspec.structs.replace(ROUND_SIM, time_scale=3.0), WorkerConfig())
    assert scaled.step_s == pytest.approx(0.012)


def test_t_over_l_alone():
    """No prompt, negligible KV: one worker sustains T / L = (b / step time) / L answers/s."""
    model = WorkerModel.from_roofline(ROUND_SIM, WorkerConfig(max_num_seqs=64))
    profile = service_profile(model, np.array([0]), np.array([200]))
    assert profile.batch_limit == 64
    # T = 64 tokens / 4 ms = 16000 tokens/s; L = 200 → 80 answers/s (KV reads: 200·201/2 ps, negligible)
    assert profile.decode_tokens_per_s == pytest.approx(16000, rel=1e-3)
    assert profile.t_over_l_per_s == pytest.approx(80.0, rel=1e-3)
    assert profile.saturation_rate_per_s == pytest.approx(1 / (200 / 64 * 0.004 + 200 * 201 / 2 * 1e-12))


def test_kv_bound_batch():
    """A pool of 100 blocks of 16 tokens holds 10 sequences of 160 tokens: b = 10 < max_num_seqs = 64."""
    bytes_per_token = 1000
    sim = msgspec.structs.replace(ROUND_SIM, kv_bytes_per_token=bytes_per_token,
                                  kv_cache_gib=100.5 * 16 * bytes_per_token / GIB)
    model = WorkerModel.from_roofline(sim, WorkerConfig(max_num_seqs=64, block_size_tokens=16))
    assert model.kv_capacity_tokens == 1600
    profile = service_profile(model, np.array([0]), np.array([160]))
    assert profile.batch_limit == 10
    # 160 tokens at 10 per step = 16 steps of 4 ms, plus KV reads Σ_{j=1..160} j = 12880 tokens at 1 ns each
    assert profile.saturation_rate_per_s == pytest.approx(1 / (16 * 0.004 + 12880 * 1e-9))
    assert profile.t_over_l_per_s == pytest.approx((10 / 0.004) / 160, rel=1e-2)


def test_prefill_cost_adds_to_the_service_demand():
    model = WorkerModel.from_roofline(ROUND_SIM, WorkerConfig(max_num_batched_tokens=512, max_num_seqs=64))
    profile = service_profile(model, np.array([1024]), np.array([64]))
    # steps: max((1024+64)/512, 64/64) = 2.125; compute 1024 × 2 µs; KV: prefill chunks 512 + 1024, decode
    # Σ_{j=1..64} (1024 + j) = 65536 + 2080, at 1 ps each
    expected = 2.125 * 0.004 + 1024 * 2e-6 + (512 + 1024 + 65536 + 2080) * 1e-12
    assert float(profile.service_s[0]) == pytest.approx(expected)
    assert float(profile.prefill_service_s[0]) == pytest.approx(1024 / 512 * 0.004 + 1024 * 2e-6 + 1536e-12)


def test_erlang_c_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = ρ
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9)
    assert erlang_c(2, 2.0) == 1.0


def test_mmc_and_allen_cunneen_waits():
    assert mmc_mean_wait_s(2, 1.0, 1.0) == pytest.approx(1 / 3)  # C / (cμ − λ) = (1/3) / 1
    assert mmc_mean_wait_s(1, 0.5, 1.0) == pytest.approx(1.0)  # ρ / (μ − λ)
    # M/D/1 (Cs² = 0): half of M/M/1, which is the exact Pollaczek–Khinchine value ρ / (2μ(1 − ρ)) = 0.5
    assert allen_cunneen_wait_s(1, 0.5, 1.0, 1.0, 0.0) == pytest.approx(0.5)
    assert mmc_mean_wait_s(1, 1.0, 1.0) == float("inf")


def test_priority_classes_conserve_the_fcfs_wait():
    """M/M/1, ρ = 0.5 split 0.25 / 0.25: W0 = 0.5; W1 = 0.5 / 0.75, W2 = 0.5 / (0.75 · 0.5); mean = FCFS = 1."""
    high, low = priority_waits_s(1.0, 0.5, [0.25, 0.25])
    assert high == pytest.approx(2 / 3)
    assert low == pytest.approx(4 / 3)
    assert (high + low) / 2 == pytest.approx(1.0)


def test_simulated_waits_fcfs_and_priority():
    assert list(simulate_waits(np.array([0.0, 0.0, 0.0]), np.array([1.0, 1.0, 1.0]), 2)) == [0.0, 0.0, 1.0]
    waits = simulate_waits(np.array([0.0, 0.1, 0.2]), np.ones(3), 1, priority=np.array([0, 0, 5]))
    assert list(waits) == pytest.approx([0.0, 1.9, 0.8])


def test_workers_needed_for_a_stable_queue_without_prompts():
    """No prompt work means no wait; the count is set by stability: λ = 2.5 μ needs 3 workers (ρ = 0.83)."""
    model = WorkerModel.from_roofline(ROUND_SIM, WorkerConfig(max_num_seqs=64))
    mu = service_profile(model, np.array([0]), np.array([200])).saturation_rate_per_s
    workload = workload_from_rate(2.5 * mu, [0], [200], {"vip": 1.0})
    result = plan(model, workload, {"vip": 1.0}, None, target=0.99)
    assert result.workers_needed == 3
    assert result.prediction.utilisation == pytest.approx(2.5 / 3)
    assert result.one_fewer.tiers[0].attainment == 0.0


def test_queueing_case_attainment_matches_erlang_c():
    """Fixed prompts, Poisson arrivals, FCFS, 2 workers at one Erlang of prefill work: the share of requests whose
    TTFT is their own prefill time (no wait) is 1 − C(2, a) ≈ 1 − 1/3."""
    model = WorkerModel.from_roofline(ROUND_SIM, WorkerConfig(max_num_seqs=64, max_num_batched_tokens=512))
    inputs, outputs = [2048], [1]
    profile = service_profile(model, np.array(inputs), np.array(outputs))
    prefill_s = float(profile.prefill_service_s[0])
    rate = 1.0 / prefill_s
    workload = workload_from_rate(rate, inputs, outputs, {"standard": 1.0})
    own_s = predict(model, workload, 2, {"standard": 100.0}, None).tiers[0].ttft_p50_s  # no wait at the median
    pred = predict(model, workload, 2, {"standard": own_s * (1 + 1e-9)}, None)
    decode_share = rate / 2 * float((profile.service_s - profile.prefill_service_s)[0])
    a = rate * prefill_s / (1 - decode_share)  # offered prefill load in Erlangs, ≈ 1
    assert pred.tiers[0].attainment == pytest.approx(1 - erlang_c(2, a), rel=1e-6)
    assert pred.tiers[0].attainment == pytest.approx(2 / 3, abs=0.01)
    assert pred.utilisation == pytest.approx(rate * float(profile.service_s[0]) / 2)


def empty_config(tmp_path):
    """Return an empty config.toml: the built-in defaults, whatever config.toml the working directory holds."""
    path = tmp_path / "empty.toml"
    path.write_text("")
    return str(path)


def test_cli_plan_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--rate-per-s", "5", "--input-tokens", "512", "--output-tokens", "128", "--json", str(out),
                 "--config", empty_config(tmp_path), "--roofline"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("planning for the built-in [sim] roofline") and "(--roofline)" in text
    assert "workers needed: 1" in text
    data = json.loads(out.read_text())
    assert data["workers_needed"] == 1
    assert {t["name"] for t in data["prediction"]["tiers"]} == {"vip", "standard", "free"}
    assert data["saturation_rate_per_worker_s"] > data["sustained_rate_per_worker_s"] > 5


def test_cli_plan_on_a_trace_needs_more_workers_at_a_higher_rate(tmp_path):
    counts = []
    for scale in (2, 8):
        out = tmp_path / f"plan{scale}.json"
        assert main(["--trace", "azure-conv", "--rate-scale", str(scale), "--max-requests", "400", "--json", str(out),
                     "--config", empty_config(tmp_path), "--roofline"]) == 0
        counts.append(json.loads(out.read_text())["workers_needed"])
    assert counts[0] < counts[1]


def run_cli_expecting_usage_error(argv, capsys):
    """Run ``sluice plan argv``; assert an argparse usage error (exit 2); return stderr."""
    with pytest.raises(SystemExit) as exc_info:
        main(argv)
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sluice plan")
    return err


@pytest.mark.parametrize(("argv", "message"), [
    (["--rate-per-s", "0"], "argument --rate-per-s: must be a number > 0, got 0"),
    (["--rate-per-s", "-1"], "argument --rate-per-s: must be a number > 0, got -1"),
    (["--rate-per-s", "nan"], "argument --rate-per-s: must be a number > 0, got nan"),
    (["--rate-per-s", "inf"], "argument --rate-per-s: must be a number > 0, got inf"),
    (["--rate-per-s", "fast"], "argument --rate-per-s: expected a number > 0, got 'fast'"),
    (["--rate-per-s", "5", "--input-tokens", "-1"], "argument --input-tokens: must be an integer ≥ 0, got -1"),
    (["--rate-per-s", "5", "--output-tokens", "0"], "argument --output-tokens: must be an integer ≥ 1, got 0"),
    (["--rate-per-s", "5", "--output-tokens", "1.5"], "argument --output-tokens: expected an integer ≥ 1, got '1.5'"),
    (["--rate-per-s", "5", "--arrival-cv2", "-1"], "argument --arrival-cv2: must be a number ≥ 0, got -1"),
    (["--rate-per-s", "5", "--time-scale", "0"], "argument --time-scale: must be a number > 0, got 0"),
    (["--rate-per-s", "5", "--slo-attainment", "0"], "argument --slo-attainment: must be a number in (0, 1], got 0"),
    (["--rate-per-s", "5", "--slo-attainment", "1.5"],
     "argument --slo-attainment: must be a number in (0, 1], got 1.5"),
    (["--rate-per-s", "5", "--max-workers", "0"], "argument --max-workers: must be an integer in [1, 4096], got 0"),
    (["--rate-per-s", "5", "--max-workers", "5000"],
     "argument --max-workers: must be an integer in [1, 4096], got 5000"),
    (["--rate-per-s", "5", "--tier-mix", "x"], "argument --tier-mix: mix entry 'x': expected name=weight"),
    (["--rate-per-s", "5", "--tier-mix", "vip=0"], "argument --tier-mix: mix 'vip=0': weights must sum to more"),
    (["--rate-per-s", "5", "--slo-ttft-s", "vip=0"], "argument --slo-ttft-s: SLO of tier 'vip' must be > 0 seconds"),
    (["--rate-per-s", "5", "--slo-ttft-s", "vip"], "argument --slo-ttft-s: entry 'vip': expected name=number"),
    (["--rate-per-s", "5", "--slo-ttft-s", "gold=1"],
     "argument --slo-ttft-s: no SLO for any tier of --tier-mix (vip, standard, free)"),
    (["--rate-per-s", "5", "--from-status", "http://example.com:8000"],
     "argument --from-status: expected http://HOST:PORT with a loopback HOST"),
    (["--rate-per-s", "5", "--queue-model", "trace"], "argument --queue-model: 'trace' needs --trace"),
    (["--rate-per-s", "5", "--max-requests", "10"], "argument --max-requests: only applies with --trace"),
    (["--trace", "azure-conv", "--input-tokens", "10"], "argument --input-tokens: only applies with --rate-per-s"),
    (["--trace", "azure-conv", "--rate-per-s", "5"], "argument --rate-per-s: not allowed with argument --trace"),
    ([], "one of the arguments --trace --rate-per-s is required"),
    (["--trace", "azure-conv", "--rate-scale", "0"], "argument --rate-scale: must be a number > 0, got 0"),
    (["--trace", "azure-conv", "--max-requests", "1"], "argument --max-requests: must be an integer ≥ 2, got 1"),
    (["--trace", "azure-conv", "--duration-s", "0"], "argument --duration-s: must be a number > 0, got 0"),
    (["--trace", "azure-conv", "--start-s", "-1"], "argument --start-s: must be a number ≥ 0, got -1"),
    (["--trace", "azure-conv", "--window-s", "0"], "argument --window-s: must be a number > 0, got 0"),
    (["--trace", "no-such-trace"], "argument --trace: trace 'no-such-trace': no such file"),
])
def test_cli_plan_rejects_a_bad_option_with_a_usage_error(tmp_path, capsys, argv, message):
    err = run_cli_expecting_usage_error([*argv, "--config", empty_config(tmp_path)], capsys)
    assert f"sluice plan: error: {message}" in err


def test_cli_plan_rejects_a_missing_config_or_output_folder(tmp_path, capsys):
    err = run_cli_expecting_usage_error(["--rate-per-s", "5", "--config", str(tmp_path / "absent.toml")], capsys)
    assert f"argument --config: no such file {tmp_path / 'absent.toml'}" in err
    err = run_cli_expecting_usage_error(["--rate-per-s", "5", "--config", empty_config(tmp_path), "--json",
                                         str(tmp_path / "no" / "plan.json")], capsys)
    assert f"argument --json: no such directory {tmp_path / 'no'}" in err


def test_cli_plan_rejects_a_trace_window_with_fewer_than_two_requests(tmp_path, capsys):
    err = run_cli_expecting_usage_error(["--trace", "azure-conv", "--start-s", "1e9", "--config",
                                         empty_config(tmp_path)], capsys)
    assert "argument --trace: a trace needs at least two requests (in the window that --start-s" in err


@pytest.fixture
def status_server():
    """A loopback HTTP server answering ``GET /status`` with the JSON in ``server.status``."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = json.dumps(self.server.status).encode()
            self.send_response(200 if self.path == "/status" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.status = {"workers": []}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def cpu_worker_status(decode: float, sequence_decode: float, prefill: float) -> dict:
    return {"workers": [{"name": "w0", "capacity": {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill,
                                                    "sequence_decode_tokens_per_s": sequence_decode}}]}


def test_measured_worker_model_takes_the_tpot_from_the_sequence_decode_rate(status_server):
    """A CPU worker decoding 4 sequences at TPOT 142 ms: the plan's TPOT is 142 ms, not b ÷ the decode rate."""
    status_server.status = cpu_worker_status(decode=4 / 0.142, sequence_decode=1 / 0.142, prefill=130.0)
    url = f"http://127.0.0.1:{status_server.server_port}"
    model = measured_worker_model(url, WorkerModel.from_roofline(SimConfig(), WorkerConfig()))
    assert model.measured_tpot_s == pytest.approx(0.142)
    assert model.measured_prefill_tokens_per_s == 130.0 and model.source == f"measured:{url}"
    profile = service_profile(model, np.array([4808, 36]), np.array([64, 64]))
    assert profile.prefill_service_s[0] == pytest.approx(4808 / 130.0)
    own_prefill_s, tpot_s, _ = _own_prefill_s(model, np.array([4808, 36]), 0.01, profile)
    assert tpot_s == pytest.approx(0.142)


def config_for_gateway(tmp_path, port: int) -> str:
    path = tmp_path / "gateway.toml"
    path.write_text(f"[gateway]\nport = {port}\n")
    return str(path)


def test_plan_uses_the_config_gateways_live_rates_by_default(status_server, tmp_path, capsys):
    status_server.status = cpu_worker_status(decode=4 / 0.142, sequence_decode=1 / 0.142, prefill=130.0)
    out = tmp_path / "plan.json"
    assert main(["--rate-per-s", "0.05", "--input-tokens", "260", "--output-tokens", "28", "--json", str(out),
                 "--config", config_for_gateway(tmp_path, status_server.server_port)]) == 0
    text = capsys.readouterr().out
    url = f"http://127.0.0.1:{status_server.server_port}"
    assert text.startswith(f"planning from the rates the workers of {url} measured (decode 28.2 tokens/s, "
                           "prefill 130 tokens/s)")
    assert json.loads(out.read_text())["worker_source"] == f"measured:{url}"


def test_plan_says_why_it_falls_back_to_the_roofline(status_server, tmp_path, capsys):
    status_server.status = {"workers": [{"name": "w0", "capacity": {"decode_tokens_per_s": 0.0}}]}  # fresh
    assert main(["--rate-per-s", "5", "--input-tokens", "512", "--output-tokens", "128",
                 "--config", config_for_gateway(tmp_path, status_server.server_port)]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line.startswith("planning for the built-in [sim] roofline (8.03 B parameters, 4800 GB/s HBM")
    assert "no worker reports a decode rate yet" in first_line and "--from-status URL" in first_line


def test_a_plan_no_worker_count_meets_says_why():
    """A TTFT target shorter than a prompt's own prefill: no count of workers meets it, and the table says why."""
    model = WorkerModel.from_roofline(ROUND_SIM, WorkerConfig(max_num_seqs=64, max_num_batched_tokens=512))
    inputs, outputs = [2048], [1]
    prefill_s = float(service_profile(model, np.array(inputs), np.array(outputs)).prefill_service_s[0])
    workload = workload_from_rate(0.1 / prefill_s, inputs, outputs, {"vip": 1.0})
    result = plan(model, workload, {"vip": prefill_s / 10}, None, target=0.99)
    assert result.workers_needed is None and result.sustained_rate_per_worker_s == 0
    text = format_plan(result)
    assert "workers needed: more than the limit" in text and "why: even an idle worker misses the TTFT targets" in text
