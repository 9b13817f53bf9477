"""Check the capacity planner against replays (issue 8): for the Azure 2023 conv and code traces at three rates,
the planner's worker count meets the SLO in ``sluice replay`` with sim workers, and one worker fewer does not.

For each trace (its first ``--requests`` requests), three rate scales are picked where the planner answers three
consecutive worker counts (conv: 1, 2, 3; code: 4, 5, 6 — its bursts need more workers for the same mean rate, and
low rates would make the replays minutes long): 90% of the highest rate scale at which the planner still answers
that count, so the count has a little margin and one fewer is past the planner's limit. Then each (trace, rate)
is replayed with the planned count c and with c − 1 workers (c − 1 = 0 cannot serve at all and is not run). Replays use admission off
(one FIFO queue: the planner's ``--order fifo``), tiers 20/60/20, SLO TTFT ≤ 1 s vip and ≤ 5 s others in simulated
time (× ``--time-scale``), and a tier "meets" its SLO when its attainment ≥ ``--attainment``.

Writes ``bench/results/plan_check.json`` and prints a table.

    .venv/bin/python -m bench.plan_check [--requests 160] [--time-scale 2] [--attainment 0.9]
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
from loadtest.prompts import PromptBuilder, load_tokenizer  # noqa: E402
from loadtest.summary import summarize  # noqa: E402
from loadtest.traces import assign_tiers, load_trace, parse_mix, shape_trace, trace_stats  # noqa: E402
from shared.config import SimConfig, WorkerConfig  # noqa: E402
from sluice.plan import WorkerModel, plan, workload_from_trace  # noqa: E402

TIER_MIX = "vip=0.2,standard=0.6,free=0.2"
SLO_TTFT_S = {"vip": 1.0, "standard": 5.0, "free": 5.0}
TRACES = ("azure-conv", "azure-code")
TARGET_COUNTS = {"azure-conv": (1, 2, 3), "azure-code": (4, 5, 6)}
RATE_MARGIN = 0.9


def planned_workers(model, base, rate_scale: float, slo, target: float) -> tuple[int | None, dict]:
    requests = assign_tiers(shape_trace(base, rate_scale=rate_scale), parse_mix(TIER_MIX), seed=0)
    result = plan(model, workload_from_trace(requests, 30.0, SimConfig().max_model_len_tokens), slo, None, target,
                  max_workers=16, with_sustained_rate=False)
    return result.workers_needed, result.to_dict()


def pick_rate_scales(model, base, slo, target: float, counts_wanted) -> dict[int, float]:
    """Return a rate scale per wanted worker count: 90% of the highest grid scale where the planner says c."""
    grid = [0.25 * 1.04 ** i for i in range(180)]
    counts = [planned_workers(model, base, s, slo, target)[0] for s in grid]
    picks: dict[int, float] = {}
    for c in counts_wanted:
        scales = [s for s, n in zip(grid, counts) if n == c]
        if scales:
            picks[c] = RATE_MARGIN * scales[-1]
    return picks


def meets(summary: dict, target: float) -> bool:
    return all((t["slo_attainment"] or 0.0) >= target for t in summary["tiers"].values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    from msgspec.structs import replace

    time_scale = args.time_scale
    slo = {tier: s * time_scale for tier, s in SLO_TTFT_S.items()}
    model = WorkerModel.from_roofline(replace(SimConfig(), time_scale=time_scale), WorkerConfig())
    started = time.time()
    cases = []
    for trace in args.traces.split(","):
        base = shape_trace(load_trace(trace), max_requests=args.requests)
        wanted = TARGET_COUNTS.get(trace, (1, 2, 3))
        for c, scale in sorted(pick_rate_scales(model, base, slo, args.attainment, wanted).items()):
            workers, prediction = planned_workers(model, base, scale, slo, args.attainment)
            requests = assign_tiers(shape_trace(base, rate_scale=scale), parse_mix(TIER_MIX), seed=0)
            cases.append({"trace": trace, "rate_scale": scale, "rate_per_s": trace_stats(requests).rate_per_s,
                          "planned_workers": workers, "plan": prediction, "requests": requests, "replays": {}})
    builder = PromptBuilder(load_tokenizer())
    worker_counts = sorted({n for case in cases for n in (case["planned_workers"], case["planned_workers"] - 1)
                            if n and n > 0})
    salt = 1000
    for n in worker_counts:
        with SimGateway(n, f"[sim]\ntime_scale = {time_scale}\n", {"SLUICE_ADMISSION__ENABLED": "false"}) as gw:
            for case in cases:
                if n not in (case["planned_workers"], case["planned_workers"] - 1):
                    continue
                salt += 1
                run = replay(gw, case["requests"], slo, builder, prompt_salt=salt,
                             drain_timeout_s=max(30.0, 6 * slo["standard"]))
                summary = summarize(run.results, slo)
                case["replays"][n] = {
                    "meets_slo": meets(summary, args.attainment), "wall_s": run.wall_s,
                    "attainment": {t: s["slo_attainment"] for t, s in summary["tiers"].items()},
                    "ttft_p50_s": {t: s["ttft_s"]["p50"] for t, s in summary["tiers"].items()},
                    "ttft_p99_s": {t: s["ttft_s"]["p99"] for t, s in summary["tiers"].items()},
                    "summary": summary}
                print(f"{case['trace']} x{case['rate_scale']:.2f} with {n} workers: attainment "
                      f"{ {t: round(a or 0, 3) for t, a in case['replays'][n]['attainment'].items()} }", flush=True)
    print(f"\n{'trace':<12}{'rate/s':>8}{'planned':>9}{'pred p99 s (vip/std)':>22}{'replay c':>10}"
          f"{'replay c-1':>12}{'planner right':>15}")
    ok_all = True
    for case in cases:
        c = case["planned_workers"]
        at_c = case["replays"].get(c, {}).get("meets_slo")
        at_less = case["replays"].get(c - 1, {}).get("meets_slo", False) if c > 1 else False
        right = bool(at_c) and not at_less
        ok_all &= right
        case["planner_right"] = right
        tiers = {t["name"]: t for t in case["plan"]["prediction"]["tiers"]}
        pred = f"{tiers['vip']['ttft_p99_s'] or math.inf:.2f}/{tiers['standard']['ttft_p99_s'] or math.inf:.2f}"
        print(f"{case['trace']:<12}{case['rate_per_s']:>8.2f}{c:>9}{pred:>22}{'meets' if at_c else 'MISSES':>10}"
              f"{('meets' if at_less else 'misses') if c > 1 else 'n/a':>12}{str(right):>15}")
        del case["requests"]
    result = {"time_scale": time_scale, "slo_ttft_s_scaled": slo, "attainment_target": args.attainment,
              "requests_per_replay": args.requests, "tier_mix": TIER_MIX, "all_right": ok_all,
              "bench_wall_s": time.time() - started, "cases": cases}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_check.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out_dir / 'plan_check.json'} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
