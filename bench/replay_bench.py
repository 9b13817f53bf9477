"""Overload bench (issue 3): the Azure 2023 code trace at 1×, 2×, 4× the capacity of 2 sim workers, admission on
vs off.

Capacity comes from the planner (``sluice.plan``): one sim worker saturates at ``mu = 1 / E[S]`` answers/s for the
trace's lengths; 2 workers sustain ``2·mu``. The trace (its first ``--requests`` requests) is rate-scaled so its
mean arrival rate is k × 2·mu for k = 1, 2, 4. Tiers 20% vip / 60% standard / 20% free (seeded); SLO TTFT ≤ 1 s
for vip and ≤ 5 s for the others, in simulated time: every duration of the simulated GPU is multiplied by
``--time-scale`` (``sim.time_scale``), and so are the SLOs, the tiers' queue deadlines (0.8 × the tier's SLO) and
the aging rate (divided), so the bench is the same experiment at a pace this 2-core machine can drive. Side by side in the same run: admission off
(``SLUICE_ADMISSION__ENABLED=false``: one FIFO queue, no deadlines, no caps).

Writes ``bench/results/replay_bench.json`` (per run: the per-tier summary) and two PNGs per run under
``bench/results/replay_bench/``. Checks at 2× (issue 3 targets): vip SLO attainment ≥ 99%, total goodput ≥ 2× the
FIFO baseline's, no request waited past its tier's deadline (``x-sluice-queue-ms``), every rejection carried
``Retry-After``.

    .venv/bin/python -m bench.replay_bench [--requests 300] [--time-scale 2] [--multiples 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.harness import SimGateway, replay  # noqa: E402
from loadtest.plots import plot_replay  # noqa: E402
from loadtest.prompts import PromptBuilder, load_tokenizer  # noqa: E402
from loadtest.summary import format_table, summarize  # noqa: E402
from loadtest.traces import assign_tiers, load_trace, parse_mix, shape_trace, trace_stats  # noqa: E402
from shared.config import DEFAULT_TIERS, SimConfig, WorkerConfig  # noqa: E402
from sluice.plan import WorkerModel, service_profile, workload_from_trace  # noqa: E402

TIER_MIX = "vip=0.2,standard=0.6,free=0.2"
# bin of the burstiness measure that picks the trace window, trace seconds
STEADY_BIN_S = 20.0
SLO_TTFT_S = {"vip": 1.0, "standard": 5.0, "free": 5.0}
# each tier's queue deadline as a share of its TTFT SLO (the rest of the SLO is left for the prefill)
DEADLINE_FRACTION_OF_SLO = 0.8
# the tiers' real-time queue deadlines before time scaling, seconds
QUEUE_TIMEOUT_S = {tier.name: DEADLINE_FRACTION_OF_SLO * SLO_TTFT_S.get(tier.name, tier.queue_timeout_s)
                   for tier in DEFAULT_TIERS}
# config.toml's aging rate (priority points per second waited), before time scaling
AGING_RATE_PER_S = 0.1


def bench_config(time_scale: float) -> str:
    """Return the gateway config of the bench: default tier vip (the header lowers it); each tier's queue deadline
    is :data:`DEADLINE_FRACTION_OF_SLO` of its TTFT SLO, and every time constant (deadlines, aging) is time-scaled.

    The deadline follows the SLO because an answer that starts after its SLO adds nothing to goodput: an operator
    who promises vip a first token within 1 s sheds a vip request that has waited most of that second rather than
    spend the GPU on it (the rest of the SLO is left for the prefill).
    """
    lines = ['default_tier = "vip"', "", "[sim]", f"time_scale = {time_scale}", "",
             "[admission]", f"aging_rate_per_s = {AGING_RATE_PER_S / time_scale}", ""]
    for tier in DEFAULT_TIERS:
        lines += ["[[tiers]]", f'name = "{tier.name}"', f"priority = {tier.priority}",
                  f"queue_capacity = {tier.queue_capacity}",
                  f"queue_timeout_s = {QUEUE_TIMEOUT_S[tier.name] * time_scale}",
                  f"default_max_tokens = {tier.default_max_tokens}", f"max_tokens = {tier.max_tokens}",
                  f"reserved_kv_fraction = {tier.reserved_kv_fraction}",
                  f"reserved_slot_fraction = {tier.reserved_slot_fraction}", ""]
    return "\n".join(lines)


def capacity_per_worker(requests, time_scale: float) -> float:
    """Return the planner's saturation rate of one sim worker for these requests, answers/s (wall clock)."""
    from msgspec.structs import replace

    model = WorkerModel.from_roofline(replace(SimConfig(), time_scale=time_scale), WorkerConfig())
    workload = workload_from_trace(requests, 30.0, SimConfig().max_model_len_tokens)
    return service_profile(model, workload.input_tokens, workload.output_tokens).saturation_rate_per_s


def steadiest_start_s(trace, num_requests: int, bin_s: float = STEADY_BIN_S, step_s: float = 30.0) -> float:
    """Return the trace time (s, a multiple of ``step_s``) where the window of ``num_requests`` requests is least
    bursty: the smallest peak ÷ mean count of arrivals per ``bin_s`` trace seconds.

    "k × capacity" is a mean rate; it means an overload of about k only over a window whose rate is near-stationary.
    The trace's first requests hold idle minutes and bursts of 4–5× their mean (the autoscaling bench wants
    exactly that; this one measures admission at a given overload).
    """
    import numpy as np

    arrivals = np.array([r.arrival_s for r in trace])
    best_ratio, best_start = math.inf, 0.0
    start = 0.0
    while True:
        first = int(np.searchsorted(arrivals, start))
        window = arrivals[first:first + num_requests]
        if len(window) < num_requests:
            return best_start
        counts, _ = np.histogram(window, bins=max(1, int((window[-1] - window[0]) / bin_s)))
        ratio = counts.max() / counts.mean()
        if ratio < best_ratio:
            best_ratio, best_start = ratio, start
        start += step_s


def vip_prefill_bound(requests, workers: int, time_scale: float, slo_s: float) -> float:
    """Return the share of vip requests that get their first token within ``slo_s`` (wall seconds) when the
    workers serve vip alone and do nothing but prefill: first come first served on ``workers`` servers, each
    prompt taking its chunked prefill time on the simulated GPU (``ceil(prompt ÷ chunk)`` steps of a full
    ``worker.max_num_batched_tokens`` chunk, from the sim's roofline, × ``time_scale``), and a request that
    cannot make ``slo_s`` dropped at once without using a server.

    A reference, not a strict bound: it leaves out decode steps, lower-tier work in flight when a burst starts and
    gateway or network time (optimistic), but runs each prompt alone in whole chunks, where the scheduler fills a
    prompt's last partial chunk with the next prompt (pessimistic); on the final code the bench's vip attainment at
    2× (99.2%) is above it (98.75%). Ordering by shortest prompt first did worse in this model on these arrivals:
    shorter prompts jump ahead, longer ones miss.
    """
    import heapq

    from worker.backends.sim import step_time_s

    chunk = WorkerConfig().max_num_batched_tokens
    step_s = step_time_s(SimConfig(), chunk, chunk) * time_scale
    free_at = [0.0] * workers
    met = 0
    vips = sorted((r.arrival_s, r.input_tokens) for r in requests if r.tier == "vip")
    for arrival_s, input_tokens in vips:
        server_free_s = heapq.heappop(free_at)
        start_s = max(arrival_s, server_free_s)
        done_s = start_s + math.ceil(max(1, input_tokens) / chunk) * step_s
        if done_s - arrival_s <= slo_s:
            met += 1
            heapq.heappush(free_at, done_s)
        else:
            heapq.heappush(free_at, server_free_s)
    return met / len(vips) if vips else 1.0


def max_queue_overrun_ms(results, time_scale: float) -> float | None:
    """Return the largest (queue wait − tier deadline) in ms over OK requests, or None without the header."""
    overruns = [r.queue_ms - QUEUE_TIMEOUT_S.get(r.tier, 0.0) * time_scale * 1000 for r in results
                if r.outcome == "ok" and r.queue_ms is not None]
    return max(overruns) if overruns else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--start-s", default="steady",
                        help="trace time to start from, seconds, or 'steady' (the least bursty window)")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--multiples", default="1,2,4")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--modes", default="admission,fifo")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    plot_dir = out_dir / "replay_bench"
    time_scale = args.time_scale
    slo = {tier: s * time_scale for tier, s in SLO_TTFT_S.items()}
    trace = load_trace("azure-code")
    start_s = steadiest_start_s(trace, args.requests) if args.start_s == "steady" else float(args.start_s)
    base = shape_trace(trace, max_requests=args.requests, start_s=start_s)
    mu = capacity_per_worker(assign_tiers(base, parse_mix(TIER_MIX)), time_scale)
    capacity = args.workers * mu
    base_rate = trace_stats(base).rate_per_s
    multiples = [float(m) for m in args.multiples.split(",")]
    print(f"capacity of {args.workers} sim workers (planner, time_scale {time_scale}): {capacity:.2f} answers/s; "
          f"trace from {start_s:g} s, rate at 1x: {base_rate:.3f}/s")
    builder = PromptBuilder(load_tokenizer())
    runs = []
    started = time.time()
    salt = 0
    for mode in args.modes.split(","):
        env = {"SLUICE_ADMISSION__ENABLED": "false"} if mode == "fifo" else {}
        with SimGateway(args.workers, bench_config(time_scale), env) as gateway:
            for k in multiples:
                rate_scale = k * capacity / base_rate
                requests = assign_tiers(shape_trace(base, rate_scale=rate_scale), parse_mix(TIER_MIX), seed=0)
                salt += 1
                run = replay(gateway, requests, slo, builder, prompt_salt=salt,
                             drain_timeout_s=max(30.0, 10 * slo["standard"]))
                summary = summarize(run.results, slo)
                name = f"{mode}_{k:g}x"
                print(f"\n== {name}: {len(requests)} requests at {trace_stats(requests).rate_per_s:.2f}/s "
                      f"(rate scale {rate_scale:.2f}), wall {run.wall_s:.1f} s")
                print(format_table(summary))
                paths = plot_replay(run.results, run.status_samples, plot_dir, slo, prefix=name,
                                    title=f"azure-code, {k:g}x capacity of {args.workers} sim workers, {mode}")
                runs.append({"name": name, "mode": mode, "multiple": k, "rate_scale": rate_scale,
                             "vip_prefill_bound": vip_prefill_bound(requests, args.workers, time_scale,
                                                                    slo["vip"]),
                             "num_requests": len(requests), "wall_s": run.wall_s, "summary": summary,
                             "max_queue_overrun_ms": max_queue_overrun_ms(run.results, time_scale),
                             "plots": [str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)
                                       for p in paths]})
    by_name = {r["name"]: r for r in runs}
    checks = {}
    if "admission_2x" in by_name and "fifo_2x" in by_name:
        adm, fifo = by_name["admission_2x"]["summary"], by_name["fifo_2x"]["summary"]
        overrun = by_name["admission_2x"]["max_queue_overrun_ms"]
        checks = {
            "vip_attainment_2x": adm["tiers"]["vip"]["slo_attainment"],
            "vip_prefill_bound_2x": by_name["admission_2x"]["vip_prefill_bound"],
            "vip_attainment_ge_99pct": adm["tiers"]["vip"]["slo_attainment"] >= 0.99,
            "goodput_2x_admission_per_s": adm["all"]["goodput_per_s"],
            "goodput_2x_fifo_per_s": fifo["all"]["goodput_per_s"],
            "goodput_ge_2x_fifo": adm["all"]["goodput_per_s"] >= 2 * fifo["all"]["goodput_per_s"],
            "max_queue_overrun_ms": overrun,
            "no_wait_past_deadline": None if overrun is None else overrun <= 0,
            "every_rejection_has_retry_after": all(
                r["summary"]["all"]["all_rejections_have_retry_after"] for r in runs if r["mode"] == "admission"),
        }
        print("\nchecks at 2x:", json.dumps(checks, indent=1))
    result = {"trace": "azure-code", "trace_start_s": start_s, "requests_per_run": args.requests,
              "time_scale": time_scale,
              "slo_ttft_s_scaled": slo, "tier_mix": TIER_MIX, "capacity_per_worker_per_s": mu,
              "capacity_per_s": capacity, "workers": args.workers, "trace_rate_1x_per_s": base_rate,
              "bench_wall_s": time.time() - started, "runs": runs, "checks_2x": checks}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "replay_bench.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_dir / 'replay_bench.json'} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
