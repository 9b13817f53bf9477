"""Compare every eviction policy with Belady's MIN on the Mooncake conversation trace (issue 4 acceptance).

Replays the trace (block 0, shared by every request, left out; so is each prompt's partial last block, which the
worker never caches: see ``worker.kv_cache.cachesim``) at 5, 10, 25 and 50% of its distinct full blocks through the
real BlockPool / PrefixCache / policies, and writes
``bench/results/cachesim.json`` and ``bench/results/cachesim.png``. Tier mix: conversations hashed to
vip / standard / free = 20 / 60 / 20% (priorities 2 / 1 / 0). Takes about a minute on one core.

    .venv/bin/python bench/cachesim_bench.py [--trace PATH]
    .venv/bin/python bench/cachesim_bench.py --split   # bench/results/cachesim_split.json, see below

``--split`` runs ``sluice cachesim TRACE --split`` at 5, 10 and 25% (lru, lfu, sluice, chain, adaptive): the first
half of the trace by time is the one policies were tuned on, the second half the one to quote (the adaptive
policy's acceptance: ≥ max(lru, lfu) − 0.5 points of Belady's share at each size, ≥ lru + 3 points at 10%).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worker.kv_cache.cachesim import (  # noqa: E402
    DEFAULT_FRACTIONS,
    DEFAULT_TIER_MIX,
    DEFAULT_TTL_S_BY_TIER,
    compare,
    format_table,
    load_trace,
    plot,
    trace_stats,
)
from worker.kv_cache import cachesim_cli  # noqa: E402
from worker.kv_cache.eviction import policy_names  # noqa: E402

SPLIT_FRACTIONS = (0.05, 0.1, 0.25)
SPLIT_POLICIES = ("lru", "lfu", "sluice", "chain", "adaptive")
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "mooncake_fast25" / "conversation_trace.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--split", action="store_true", help="tune / test halves by time (cachesim_split.json)")
    args = parser.parse_args()
    if args.split:
        return cachesim_cli.main([args.trace, "--split", "--capacity-fractions", ",".join(map(str, SPLIT_FRACTIONS)),
                                  "--policy", ",".join(SPLIT_POLICIES),
                                  "--json", str(Path(args.out_dir) / "cachesim_split.json")])
    started_s = time.perf_counter()
    requests = load_trace(args.trace)
    stats = trace_stats(requests)
    capacities = [int(f * stats["num_distinct_blocks"]) for f in DEFAULT_FRACTIONS]
    runs = compare(requests, capacities, policy_names())
    elapsed_s = time.perf_counter() - started_s
    print(f"{stats['num_requests']} requests, {stats['num_block_refs']} block refs, "
          f"{stats['num_distinct_blocks']} distinct blocks ({elapsed_s:.0f} s)")
    print(format_table(runs))
    print("top tier (vip) hit rate:")
    for entry in runs:
        vip = {name: r["hit_rate_by_tier"].get("vip", 0.0) for name, r in entry["policies"].items()}
        print(f"  {entry['capacity_fraction']:.0%}: " + "  ".join(f"{n} {v:.4f}" for n, v in vip.items())
              + f"  belady {entry['belady']['hit_rate_by_tier'].get('vip', 0.0):.4f}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"trace": Path(args.trace).name, **stats, "tier_mix": [list(t) for t in DEFAULT_TIER_MIX],
              "ttl_s_by_tier": DEFAULT_TTL_S_BY_TIER, "belady": "MIN with bypass over the block reference stream",
              "block_references": "full prompt blocks; the partial last block takes a pool block but is never cached",
              "elapsed_s": elapsed_s, "runs": runs}
    (out_dir / "cachesim.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    plot(runs, out_dir / "cachesim.png", title="Mooncake conversation trace: block hit rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
