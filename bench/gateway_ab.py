"""Two gateway builds side by side: the gateway's CPU per request of a base checkout and of this one, in one run.

On a shared 2-core virtual machine one gateway's CPU per request moved between 0.51 and 0.94 ms across the rounds of
:mod:`bench.gateway_bench` minutes apart, far more than most changes to the hot path; comparing two runs of that
bench compares two moments of the machine. Here both gateways run at once (the base from ``--base``, a checkout or
``git worktree`` of the older commit, started from its own folder; the other from this checkout) beside
:mod:`bench.bare_sse_server`, and each round runs the same closed loop on the two, in alternating order, then on the
bare server, so every round's figures share one moment. Each gateway has ``gateway_bench``'s configuration (two sim
workers, admission on) and the same load (a streamed chat request, 8 output tokens, 32 concurrent).

Reported: each round's CPU ms per request of the three, their medians, the median of the rounds' ``new ÷ base``
ratios, and each gateway's median over the bare server's. Result: JSON to ``--out`` (default
``bench/results/gateway_ab.json``).

Run: ``git worktree add /tmp/base <commit>``, then ``.venv/bin/python -m bench.gateway_ab --base /tmp/base``
(about 4 minutes with 8 rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from bench.common import mt_bench_prompts, write_result
from bench.gateway_bench import CONFIG, MODEL, bare_server, closed_loop_cpu_ms, run_client
from tests.support.server import REPO_ROOT, SluiceProcess


def start_gateway(checkout: Path, config: str, workers: int) -> SluiceProcess:
    """Start ``sluice serve`` from ``checkout``'s code and wait until its workers are ready."""
    return SluiceProcess(config, min_ready_workers=workers, code_root=checkout).start()


def commit_of(checkout: Path) -> str:
    """Return the commit ``checkout`` has checked out ("" when it is not a git checkout)."""
    result = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True)
    return result.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the base checkout (e.g. a git worktree of the older commit)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--closed-requests", type=int, default=1500, help="requests of each closed loop")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="local sim workers of each gateway")
    parser.add_argument("--warmup-requests", type=int, default=300)
    parser.add_argument("--out", default="gateway_ab", help="result name under bench/results/, or a path (.json)")
    args = parser.parse_args()

    base_checkout = Path(args.base).resolve()
    prompts = mt_bench_prompts(80)
    config = CONFIG.format(model=MODEL, workers=args.workers, time_scale=0.2)
    gateways = {"base": start_gateway(base_checkout, config, args.workers)}
    rounds = []
    try:
        gateways["new"] = start_gateway(REPO_ROOT, config, args.workers)
        with bare_server(prompts, args) as bare:
            for gateway in gateways.values():
                run_client(gateway.base_url, prompts, args.client_processes, concurrency=args.concurrency,
                           num_requests=args.warmup_requests, rate_rps=None, limit_s=60.0)
            for index in range(args.rounds):
                order = ["base", "new"] if index % 2 == 0 else ["new", "base"]
                row = {name: closed_loop_cpu_ms(gateways[name].base_url, gateways[name].process.pid, prompts, args)
                       for name in order}
                row["bare"] = closed_loop_cpu_ms(*bare, prompts, args)
                rounds.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for gateway in gateways.values():
            gateway.stop()
    medians = {name: statistics.median(row[name] for row in rounds) for name in ("base", "new", "bare")}
    result = {
        "bench": "gateway_ab",
        "base": {"checkout": str(base_checkout), "commit": commit_of(base_checkout)},
        "new": {"checkout": str(REPO_ROOT), "commit": commit_of(REPO_ROOT)},
        "config": {"rounds": args.rounds, "closed_requests": args.closed_requests,
                   "concurrency": args.concurrency, "client_processes": args.client_processes,
                   "workers": args.workers},
        "cpu_ms_per_request_median": medians,
        "new_over_base_median_of_rounds": round(statistics.median(row["new"] / row["base"] for row in rounds), 3),
        "rounds_new_below_base": sum(row["new"] < row["base"] for row in rounds),
        "base_over_bare": round(medians["base"] / medians["bare"], 3),
        "new_over_bare": round(medians["new"] / medians["bare"], 3),
        "rounds": rounds,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
