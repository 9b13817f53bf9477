"""Autoscaling bench (issue 7): the Azure 2023 code trace (bursty, with idle gaps) at 2× the capacity of 2 sim
workers, served by a pool that autoscales between 0 and 4 sim workers and, side by side in the same run, by a
fixed fleet of 4.

Capacity comes from the planner (``sluice.plan``), as in ``bench/replay_bench.py``: one sim worker (the roofline
SIMULATOR of an H200 serving Llama-3-8B) saturates at ``mu`` answers/s for the trace's lengths, so 2 workers sustain
``2·mu``. The trace (its first ``--requests`` requests) is rate-scaled so that ``--multiple`` × 2·mu is, with
``--load``:

- ``busy`` (the default): its rate *while busy*, the requests over the 10-s windows of the trace that hold an
  arrival (:func:`loadtest.traces.busy_rate_per_s`). The bursts come at 2× the capacity of 2 workers, which is what
  the fixed fleet of 4 is sized for, and the idle gaps between them stay idle (about 60% of the 10-s windows of
  the first 1200 requests hold no arrival).
- ``mean``: its mean rate, the bursts spread over the gaps. The fleet of 4 then has to carry its full capacity on
  average, so the bursts overload it and its queues drain into the gaps: it is busy about 64% of its
  worker-seconds, and an autoscaled fleet of at most 4 that does the same work cannot spend less than that.
  Kept for comparison (``bench/results/autoscale_mean_rate.json``).

Tiers 20% vip / 60% standard / 20% free (seeded); SLO TTFT ≤ 1 s for vip, ≤ 5 s for the others, in simulated time:
every simulated duration is multiplied by ``--time-scale`` and so are the SLOs and the tiers' queue deadlines, so the
experiment runs at a pace this machine can drive. A sim worker's cold start here (spawn → Hello: Python start and the
tokenizer load) is real wall time, not scaled: at ``--time-scale`` k it stands for a cold start k times shorter on the
simulated GPU.

Worker-seconds are counted over the replay (from its first arrival to its end) from the gateway's ``/status``: every
second a local worker process exists, starting and draining included.

The two fleets run ``--repeats`` times, alternating (about 9 minutes a repeat); the checks compare medians.

Writes ``bench/results/autoscale.json`` (``autoscale_mean_rate.json`` with ``--load mean``): per run the per-tier
summary (SLO attainment, TTFT percentiles, rejections), worker-seconds, scale events and cold starts; and the checks
of issue 7 (attainment per tier no worse than the fixed fleet's, worker-seconds ≤ 60% of it), on the medians.

    .venv/bin/python -m bench.autoscale_bench [--load busy|mean] [--repeats 3] [--requests 1200] [--time-scale 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.prompts import PromptBuilder, load_tokenizer  # noqa: E402
from loadtest.replay import ReplayOptions, run_replay  # noqa: E402
from loadtest.summary import format_table, summarize  # noqa: E402
from tests.support.server import SluiceProcess  # noqa: E402
from loadtest.traces import (  # noqa: E402
    assign_tiers,
    busy_rate_per_s,
    load_trace,
    parse_mix,
    shape_trace,
    trace_stats,
)

from bench.replay_bench import SLO_TTFT_S, TIER_MIX, capacity_per_worker  # noqa: E402
from bench.replay_bench import bench_config as replay_bench_config  # noqa: E402

# the autoscaler's windows in the bench, wall seconds: low use this long stops a worker; arrivals over this long
# are the offered load (a sim worker's cold start here is about 0.3 s wall, so a short window costs little).
# Measured on --load busy, autoscaled leg alone (worker-seconds ÷ the fixed fleet's 1066; free / standard
# attainment; vip 100% but in the first, 99.2%): scale-down 1.5 s and target wait 0.5 s: 0.46, 52.5% / 84.9%;
# 4 s and 0.25 s: 0.54, 57.5% / 86.8%; 4 s and 0.1 s: 0.56, 59.2% / 88.2%; 6 s and 0.1 s: 0.60, 58.3% / 88.3%.
# Fixed fleet: 59.6% / 88.6% and 60.4% / 90.0% in two runs. The misses are all in the one burst that overloads
# 4 workers 2–3× (seconds 80–110 of the replay), whichever the fleet; scaling from zero into it starts it about a
# cold start behind. (--load mean ran with 1.5 s and 0.5 s, where the worker-seconds were the limit.)
SCALE_DOWN_AFTER_S = 4.0
# the cold-start estimate before one is measured, wall seconds: above what this bench's sim workers take (forked
# from the fork server: 0.06–0.1 s; exec'd, before: 0.2–1.8 s); the default (30 s, a GPU worker loading its model)
# would predict that the first requests of a pool at zero miss their deadlines and reject them at once
INITIAL_COLD_START_S = 1.0
# the pool's target queue wait before time scaling, seconds (the lowest tier's predicted wait is compared with it)
TARGET_QUEUE_WAIT_S = 0.1
DEMAND_WINDOW_S = 4.0
# share of a worker's measured service rate the load-proportional rule plans for (the product default is 0.9): the
# headroom that covers a burst while it is still growing. At 0.9 the pool trailed the growing onset of the burst that
# overloads 4 workers by one worker for about 1.5 s (3 ready while the fixed fleet had 4), and standard attainment
# was short by about 7 requests (autoscale_0_4_r0: 638 against 645), at 0.51 of the fixed fleet's worker-seconds.
TARGET_UTILISATION = 0.7
START_TIMEOUT_S = 300.0
MAX_WORKERS = 4
# the window of the trace's own clock over which ``--load busy`` tells busy from idle, seconds
BUSY_WINDOW_S = 10.0


def bench_config(time_scale: float, autoscale: bool, scale_down_after_s: float = SCALE_DOWN_AFTER_S,
                 demand_window_s: float = DEMAND_WINDOW_S, target_queue_wait_s: float = TARGET_QUEUE_WAIT_S) -> str:
    """Return the gateway config: the replay bench's (its tiers' deadlines at 0.8 × the tier's SLO and its aging,
    time-scaled), plus one sim pool (0..4 or fixed 4). The autoscaler's windows are wall seconds."""
    lines = [replay_bench_config(time_scale),
             "[autoscale]", f"enabled = {'true' if autoscale else 'false'}", "interval_s = 0.5",
             f"initial_cold_start_s = {INITIAL_COLD_START_S}", f"demand_window_s = {demand_window_s}",
             f"target_utilisation = {TARGET_UTILISATION}", "",
             "[[pools]]", 'name = "sim"', 'backend = "sim"',
             f"min_workers = {0 if autoscale else MAX_WORKERS}", f"max_workers = {MAX_WORKERS}",
             "scale_up_after_s = 1.0", f"scale_down_after_s = {scale_down_after_s}",
             f"target_queue_wait_s = {target_queue_wait_s * time_scale}", ""]
    return "\n".join(lines)


def get_json(url: str, timeout_s: float = 5.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


class FleetGateway(SluiceProcess):
    """``sluice serve`` with the bench config on a free loopback port, as a context manager (entered at once: the
    caller waits for the pool state it needs with :meth:`wait`)."""

    def __init__(self, config_text: str, log_path: Path) -> None:
        super().__init__(config_text, ready="none", log_path=log_path)

    def wait(self, predicate, what: str, timeout_s: float = START_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            status = get_json(self.base_url + "/status")
            if status is not None and predicate(status["fleet"]["pools"]["sim"]):
                return status
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.stop(timeout_s=60)
        self.close()


def busy_worker_seconds_of(samples) -> float:
    """Return the worker-seconds in which a worker had a sequence running or waiting, from the replay's ``/status``
    samples (each sample's state held until the next one).

    For the fixed fleet this bounds what any fleet of the same workers needs to do the same work: a worker-second
    saved below it is work not done (requests shed or served later).
    """
    total = 0.0
    for sample, following in zip(samples, samples[1:]):
        busy = sum(1 for name, running in sample.running_by_worker.items()
                   if running > 0 or sample.waiting_by_worker.get(name, 0) > 0)
        total += busy * (following.t_s - sample.t_s)
    return total


def run_one(name: str, autoscale: bool, requests, time_scale: float, slo: dict[str, float], builder,
            out_dir: Path, stem: str = "autoscale", scale_down_after_s: float = SCALE_DOWN_AFTER_S,
            demand_window_s: float = DEMAND_WINDOW_S, target_queue_wait_s: float = TARGET_QUEUE_WAIT_S) -> dict:
    """Serve ``requests`` with one fleet; return its summary, worker-seconds and scale events."""
    config = bench_config(time_scale, autoscale, scale_down_after_s, demand_window_s, target_queue_wait_s)
    with FleetGateway(config, out_dir / f"{stem}_{name}.log") as gateway:
        if autoscale:
            gateway.wait(lambda pool: pool["workers"]["ready"] == 0, "the empty pool")
        else:
            gateway.wait(lambda pool: pool["workers"]["ready"] == MAX_WORKERS, "the fixed fleet")
        before = get_json(gateway.base_url + "/status")["fleet"]["pools"]["sim"]
        opts = ReplayOptions(base_url=gateway.base_url, slo_ttft_s_by_tier=slo,
                             drain_timeout_s=max(60.0, 10 * slo["standard"]), prompt_salt=1)
        run = asyncio.run(run_replay(requests, opts, builder))
        status = get_json(gateway.base_url + "/status")
        after = status["fleet"]["pools"]["sim"]
    summary = summarize(run.results, slo)
    worker_seconds = after["worker_seconds"] - before["worker_seconds"]
    busy_worker_seconds = busy_worker_seconds_of(run.status_samples)
    print(f"\n== {name}: {len(requests)} requests, wall {run.wall_s:.1f} s, worker-seconds {worker_seconds:.1f} "
          f"(busy {busy_worker_seconds:.1f})")
    print(format_table(summary))
    return {
        "name": name, "autoscale": autoscale, "wall_s": run.wall_s, "worker_seconds": worker_seconds,
        "busy_worker_seconds": busy_worker_seconds,
        "summary": summary, "scale_events": status["fleet"]["scale_events"],
        "cold_start_s": after["cold_start_s"], "num_cold_starts": after["num_cold_starts"],
        "timeline": [{"t_s": round(s.t_s, 2), "queued": sum(s.queue_depth_by_tier.values()),
                      "workers": len(s.running_by_worker), "pressure": s.pressure}
                     for s in run.status_samples[:: max(1, len(run.status_samples) // 200)]],
    }


def compare(pairs: list[list[dict]]) -> dict:
    """Return issue 7's checks over repeated side-by-side runs ``[[autoscaled, fixed], ...]`` (``run_one``'s dicts).

    Per repeat, the autoscaled fleet's worker-seconds ÷ the fixed fleet's and each tier's SLO attainment; the checks
    compare the medians over the repeats (one run's attainment moves by a point or two between runs of the same
    fleet here), and every repeat's values are listed beside them.
    """
    ratios = [auto["worker_seconds"] / fixed["worker_seconds"] for auto, fixed in pairs if fixed["worker_seconds"]]
    fixed_busy = [fixed["busy_worker_seconds"] / fixed["worker_seconds"] for _, fixed in pairs
                  if fixed["worker_seconds"]]
    checks: dict = {"repeats": len(pairs), "worker_seconds_ratio": statistics.median(ratios) if ratios else None,
                    "worker_seconds_ratio_by_repeat": ratios,
                    "fixed_busy_share_of_worker_seconds": statistics.median(fixed_busy) if fixed_busy else None}
    checks["worker_seconds_le_60pct"] = checks["worker_seconds_ratio"] is not None and \
        checks["worker_seconds_ratio"] <= 0.6
    for tier in sorted(SLO_TTFT_S):
        by_fleet = {}
        for index, fleet in enumerate(("autoscale", "fixed")):
            values = [pair[index]["summary"]["tiers"].get(tier, {}).get("slo_attainment") for pair in pairs]
            values = [v for v in values if v is not None]
            by_fleet[fleet] = statistics.median(values) if values else None
            checks[f"{tier}_attainment_{fleet}"] = by_fleet[fleet]
            checks[f"{tier}_attainment_{fleet}_by_repeat"] = values
        checks[f"{tier}_no_worse"] = (by_fleet["autoscale"] is not None and by_fleet["fixed"] is not None
                                      and by_fleet["autoscale"] >= by_fleet["fixed"])
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--multiple", type=float, default=2.0, help="offered load ÷ capacity of 2 sim workers")
    parser.add_argument("--load", choices=("busy", "mean"), default="busy",
                        help="which rate of the trace is set to --multiple × the capacity: while busy, or the mean")
    parser.add_argument("--repeats", type=int, default=3,
                        help="side-by-side runs of the two fleets; the checks compare medians")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--scale-down-after-s", type=float, default=SCALE_DOWN_AFTER_S)
    parser.add_argument("--demand-window-s", type=float, default=DEMAND_WINDOW_S)
    parser.add_argument("--target-queue-wait-s", type=float, default=TARGET_QUEUE_WAIT_S,
                        help="the pool's target queue wait before time scaling, seconds")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be ≥ 1")
    out_dir = Path(args.out_dir)
    time_scale = args.time_scale
    slo = {tier: s * time_scale for tier, s in SLO_TTFT_S.items()}
    base = shape_trace(load_trace("azure-code"), max_requests=args.requests)
    mu = capacity_per_worker(assign_tiers(base, parse_mix(TIER_MIX)), time_scale)
    capacity = 2 * mu
    base_rate = busy_rate_per_s(base, BUSY_WINDOW_S) if args.load == "busy" else trace_stats(base).rate_per_s
    rate_scale = args.multiple * capacity / base_rate
    stem = "autoscale" if args.load == "busy" else "autoscale_mean_rate"
    requests = assign_tiers(shape_trace(base, rate_scale=rate_scale), parse_mix(TIER_MIX), seed=0)
    stats = trace_stats(requests)
    print(f"capacity of 2 sim workers (planner, time_scale {time_scale}): {capacity:.2f} answers/s; offered "
          f"{stats.rate_per_s:.2f}/s over {stats.span_s:.0f} s ({len(requests)} requests, rate scale {rate_scale:.2f})")
    builder = PromptBuilder(load_tokenizer())
    started = time.time()
    windows = dict(scale_down_after_s=args.scale_down_after_s, demand_window_s=args.demand_window_s,
                   target_queue_wait_s=args.target_queue_wait_s)
    runs, pairs = [], []
    for repeat in range(args.repeats):  # the two fleets alternate, so a drift of this machine hits both
        suffix = f"_r{repeat}" if args.repeats > 1 else ""
        pair = [run_one(f"autoscale_0_4{suffix}", True, requests, time_scale, slo, builder, out_dir, stem,
                        **windows),
                run_one(f"fixed_4{suffix}", False, requests, time_scale, slo, builder, out_dir, stem, **windows)]
        runs.extend(pair)
        pairs.append(pair)
    checks = compare(pairs)
    print("\nchecks:", json.dumps(checks, indent=1))
    result = {"trace": "azure-code", "requests": len(requests), "time_scale": time_scale, "multiple": args.multiple,
              "load": args.load, "busy_window_s": BUSY_WINDOW_S if args.load == "busy" else None,
              "busy_rate_per_s": busy_rate_per_s(requests, BUSY_WINDOW_S / rate_scale),
              "slo_ttft_s_scaled": slo, "tier_mix": TIER_MIX, "capacity_per_worker_per_s": mu,
              "capacity_2_workers_per_s": capacity, "rate_scale": rate_scale, "offered_rate_per_s": stats.rate_per_s,
              "autoscale_windows_s": windows, "target_utilisation": TARGET_UTILISATION, "repeats": args.repeats,
              "bench_wall_s": time.time() - started, "runs": runs, "checks": checks}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_dir / f'{stem}.json'} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
