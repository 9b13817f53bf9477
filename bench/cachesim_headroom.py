"""Where the prefix-cache policies lose hits on the Mooncake conversation trace, and what knowing the future buys.

Issue 4 asks for 85% of Belady's hit rate at 10% capacity. This script measures why the online policies stop near
78% (``chain``), on the same replay as ``bench/cachesim_bench.py`` (the real BlockPool / PrefixCache, block 0 and
the partial last blocks left out):

1. **Reuse oracle**: an eviction policy told, for each block, whether the trace references it again (and nothing
   else: it evicts never-again blocks first, then least recently used). If it reaches Belady, the whole gap is in
   *predicting which chains come back*, not in the pool mechanics or in the age ranking.
2. **Miss breakdown** of ``lru`` and ``chain``: each reference to a block seen before, hit or miss, by the kind of
   chain that last used the block (``fresh``: the request's prompt shared no earlier block; ``returning``: it
   did) and the idle time since that use.
3. **Class × idle-age ceiling**: the most hits *any* policy can get that ranks blocks by what a worker knows when it
   releases them (a class made of the features named) and their idle time, with each class's keep time chosen in
   hindsight (:func:`class_age_ceiling`). If the ceiling of a feature set is below the target, no policy built on
   those features reaches it. The ceiling's keep times are also played in the real pool (:func:`replay_ceiling`):
   how much of it survives a pool that is full at every instant.
4. **Is a fresh conversation's return predictable?** The share of fresh conversations that come back, by what a
   worker knows when it releases the chain: prompt length, output length, time of day in the trace. A feature
   that separates returners would let a policy keep only them.

Output: ``bench/results/cachesim_headroom.json`` and a summary on stdout. Takes about a minute on one core.

    .venv/bin/python bench/cachesim_headroom.py [--trace PATH]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import sys
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cachesim_bench import DEFAULT_TRACE  # noqa: E402
from worker.kv_cache.cachesim import (  # noqa: E402
    PrefixCacheSim,
    TraceRequest,
    load_trace,
    simulate_belady,
    simulate_policy,
    trace_stats,
)
from worker.kv_cache.eviction import BlockMeta, EvictionPolicy, make_policy  # noqa: E402

FRACTIONS = (0.05, 0.1)
# feature sets of the ceiling: none (one class: a keep time for all, ~LRU), turn (chain's returning-or-not), chain's
# classes (turn × growth), then what else a worker knows at release
CEILING_FEATURES = ((), ("turn",), ("turn", "growth"), ("turn", "growth", "uses", "length"),
                    ("turn", "growth", "uses", "length", "pace"))
IDLE_BUCKETS_S = (60, 120, 240, 480, 960)


class ReuseOraclePolicy(EvictionPolicy):
    """Evict blocks that the trace never references again first, then least recently used (an offline oracle).

    Args:
        uses_s: block hash → sorted arrival times (s) of the requests that reference it.
    """

    name = "reuse_oracle"

    def __init__(self, uses_s: dict[int, list[float]]) -> None:
        self._uses_s = uses_s
        self._never: OrderedDict[int, None] = OrderedDict()  # evictable, not referenced again
        self._again: OrderedDict[int, None] = OrderedDict()  # evictable, referenced again

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        uses_s = self._uses_s.get(meta.block_hash, [])
        again = bisect.bisect_right(uses_s, now_s) < len(uses_s)
        (self._again if again else self._never)[block_id] = None

    def remove(self, block_id: int) -> None:
        if block_id in self._never:
            del self._never[block_id]
        else:
            del self._again[block_id]

    def pop_victim(self, now_s: float) -> int | None:
        for queue in (self._never, self._again):
            if queue:
                return queue.popitem(last=False)[0]
        return None

    def __len__(self) -> int:
        return len(self._never) + len(self._again)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._never or block_id in self._again


def block_uses_s(requests: Sequence[TraceRequest]) -> dict[int, list[float]]:
    """Return block hash → arrival times (s, ascending) of the requests that reference it."""
    uses: dict[int, list[float]] = defaultdict(list)
    for request in requests:
        for block_hash in request.block_hashes:
            uses[block_hash].append(request.arrival_s)
    return uses


def idle_bucket(idle_s: float) -> str:
    """Return the label of the idle-time bucket ``idle_s`` falls in (``≤60``, …, ``>960``)."""
    for bound in IDLE_BUCKETS_S:
        if idle_s <= bound:
            return f"<={bound}"
    return f">{IDLE_BUCKETS_S[-1]}"


def miss_breakdown(requests: Sequence[TraceRequest], capacity_blocks: int, policy: str) -> dict:
    """Replay with ``policy``; count hits and misses of references to blocks seen before, by kind and idle time."""
    sim = PrefixCacheSim(capacity_blocks, make_policy(policy))
    last_use_s: dict[int, float] = {}
    last_kind: dict[int, str] = {}
    hits: Counter[tuple[str, str]] = Counter()
    misses: Counter[tuple[str, str]] = Counter()
    for request in requests:
        num_hits = sim.access(request)
        hashes = request.block_hashes
        for index, block_hash in enumerate(hashes):
            if block_hash in last_use_s:
                key = (last_kind[block_hash], idle_bucket(request.arrival_s - last_use_s[block_hash]))
                (hits if index < num_hits else misses)[key] += 1
        kind = "returning" if hashes[0] in last_use_s else "fresh"
        for block_hash in hashes:
            last_use_s[block_hash] = request.arrival_s
            last_kind[block_hash] = kind
    rows = []
    for key in sorted(set(hits) | set(misses), key=lambda k: (k[0], _bucket_order(k[1]))):
        rows.append({"last_use_by": key[0], "idle_s": key[1], "hits": hits[key], "misses": misses[key]})
    return {"policy": policy, "hits": sum(hits.values()), "misses": sum(misses.values()), "by_kind_and_idle": rows}


def _bucket_order(label: str) -> int:
    return next((i for i, bound in enumerate(IDLE_BUCKETS_S) if label == f"<={bound}"), len(IDLE_BUCKETS_S))


def _log2_bucket(value: float) -> int:
    return min(int(math.log2(max(value, 1.0))), 7)


def block_class(features: Sequence[str], turn: int, num_new_blocks: int, num_uses: int, num_blocks: int,
                pace_s: float | None) -> tuple:
    """Return the class of a released block from the named features (see :func:`class_age_ceiling`)."""
    values = {"turn": min(turn, 3), "growth": _log2_bucket(num_new_blocks), "uses": min(num_uses, 4),
              "length": _log2_bucket(num_blocks),
              "pace": -1 if pace_s is None else min(int(math.log2(pace_s / 15.0 + 1.0)), 6)}
    return tuple(values[feature] for feature in features)


def release_classes(requests: Sequence[TraceRequest], features: Sequence[str]) -> tuple[dict, dict, dict, float]:
    """Classify every block release of a trace (see :func:`class_age_ceiling` for the features).

    Returns:
        ``(class_at, gaps_s, censored_s, span_s)``: class of each release keyed by ``(block hash, release time
        s)``; per class, the idle times (s) that ended in a reuse, and those cut by the end of the trace; the
        trace's span (s).
    """
    last_use: dict[int, tuple[float, tuple]] = {}
    num_uses: Counter[int] = Counter()
    pace: dict[int, float] = {}
    gaps: dict[tuple, list[float]] = defaultdict(list)
    class_at: dict[tuple[int, float], tuple] = {}
    for request in requests:
        hashes = request.block_hashes
        num_known = next((i for i, block_hash in enumerate(hashes) if block_hash not in num_uses), len(hashes))
        turn = max((num_uses[block_hash] for block_hash in hashes[:num_known]), default=0)
        for block_hash in hashes:
            if block_hash in last_use:
                released_s, released_class = last_use[block_hash]
                gaps[released_class].append(request.arrival_s - released_s)
                pace[block_hash] = request.arrival_s - released_s
        for block_hash in hashes:
            num_uses[block_hash] += 1
            released_class = block_class(features, turn, len(hashes) - num_known, num_uses[block_hash], len(hashes),
                                         pace.get(block_hash))
            last_use[block_hash] = (request.arrival_s, released_class)
            class_at[(block_hash, request.arrival_s)] = released_class
    end_s = requests[-1].arrival_s if requests else 0.0
    span_s = end_s - (requests[0].arrival_s if requests else 0.0)
    censored: dict[tuple, list[float]] = defaultdict(list)  # idle intervals cut by the end of the trace
    for released_s, released_class in last_use.values():
        censored[released_class].append(end_s - released_s)
    return class_at, gaps, censored, span_s


def class_age_ceiling(requests: Sequence[TraceRequest], capacity_blocks: int, features: Sequence[str]) -> dict:
    """Upper bound on the hits of a policy that knows a released block's class and idle time, nothing more.

    Each time a block is released (its request's time; requests are instantaneous, as in the simulator) it starts
    an idle interval that ends at its next reference (gap ``g``) or at the end of the trace (never referenced
    again). A policy that knows only the block's class ``c`` and its idle time can do no more than keep it for
    some time ``T`` chosen by class (or a mix of such times): the reference is a hit if ``g ≤ T``, and the block
    takes ``min(g, T)`` of cache time. The ceiling relaxes the pool size to a time average (total cache time ≤
    ``capacity_blocks`` × the trace span) and picks every class's ``T`` in hindsight (Lagrangian over the concave
    hull of each class's hits-vs-cache-time curve), so it bounds such policies from above; it ignores the blocks
    of running requests and the prefix rule (a block hit after its parent missed), both of which only lower a
    real policy's hits. It does not bound a policy that changes its keep times with the load over the trace
    (:func:`replay_ceiling` measures what the keep times give in a pool that is full at every instant).

    Features of the class, each known when a request releases its blocks:
        ``turn``: earlier requests that used the request's deepest already-seen block (0 = a fresh conversation),
        capped at 3; ``growth``: log2 bucket of its blocks not seen before; ``uses``: this block's uses, capped
        at 4; ``length``: log2 bucket of the request's full blocks; ``pace``: log2 bucket of the gap (s) that this
        block's previous idle interval had (-1 for a new block): a conversation's own turn rhythm.

    Returns:
        ``{"features", "num_classes", "hits", "reuse_refs", "fraction_of_reuses", "keep_s_by_class",
        "class_at"}``; ``reuse_refs`` (references to a block seen before) is what Belady with bypass reaches when
        capacity allows, and is the denominator; ``keep_s_by_class``: the hindsight keep time (s) of each class at
        the price that fits (the cheaper end of the mixed hull segment); ``class_at``: :func:`release_classes`'s
        class of each release. The last two have tuple keys (not JSON).
    """
    class_at, gaps, censored, span_s = release_classes(requests, features)
    curves = {}  # per class: (cache time, hits, keep time) at each candidate keep time
    for released_class in set(gaps) | set(censored):
        reused, cut = sorted(gaps[released_class]), sorted(censored[released_class])
        reused_sums = list(itertools.accumulate(reused, initial=0.0))
        cut_sums = list(itertools.accumulate(cut, initial=0.0))
        points = []
        for keep_s in [0.0, *reused]:
            k, j = bisect.bisect_right(reused, keep_s), bisect.bisect_right(cut, keep_s)
            cache_s = reused_sums[k] + keep_s * (len(reused) - k) + cut_sums[j] + keep_s * (len(cut) - j)
            points.append((cache_s, k, keep_s))
        curves[released_class] = points

    def choose(price: float) -> dict[tuple, tuple[float, int, float]]:
        return {c: max(points, key=lambda p: p[1] - price * p[0]) for c, points in curves.items()}

    def best(price: float) -> tuple[float, int]:
        chosen = choose(price).values()
        return sum(p[0] for p in chosen), sum(p[1] for p in chosen)

    budget_s = capacity_blocks * span_s
    low, high = 1e-12, 1e3  # price of a block-second: bisect for the cheapest that fits the budget
    for _ in range(80):
        middle = math.sqrt(low * high)
        if best(middle)[0] > budget_s:
            low = middle
        else:
            high = middle
    (fits_s, fits_hits), (over_s, over_hits) = best(high), best(low)
    hits = float(fits_hits)
    if over_s > budget_s > fits_s:  # the budget falls inside a hull segment: mix its two ends
        hits += (over_hits - fits_hits) * (budget_s - fits_s) / (over_s - fits_s)
    reuse_refs = sum(len(g) for g in gaps.values())
    return {"features": list(features), "num_classes": len(curves), "hits": hits, "reuse_refs": reuse_refs,
            "fraction_of_reuses": hits / reuse_refs if reuse_refs else 0.0,
            "keep_s_by_class": {c: point[2] for c, point in choose(high).items()}, "class_at": class_at}


class KeepTimePolicy(EvictionPolicy):
    """Give each released block a keep time by its class; evict the block whose keep time ends first (the tail of
    a chain first on a tie). With the ceiling's hindsight keep times this is the ceiling played in a real pool.

    Args:
        class_at: class of each release, keyed by ``(block hash, release time s)`` (:func:`release_classes`).
        keep_s_by_class: keep time (s) per class; a release of an unknown class is kept 0 s.
    """

    name = "keep_time"

    def __init__(self, class_at: dict[tuple[int, float], tuple], keep_s_by_class: dict[tuple, float]) -> None:
        self._class_at = class_at
        self._keep_s_by_class = keep_s_by_class
        self._heap: list[tuple[float, int, int]] = []
        self._keys: dict[int, tuple[float, int, int]] = {}

    def insert(self, block_id: int, meta: BlockMeta, now_s: float) -> None:
        keep_s = self._keep_s_by_class.get(self._class_at.get((meta.block_hash, now_s)), 0.0)
        key = (now_s + keep_s, -meta.block_idx, block_id)
        self._keys[block_id] = key
        heapq.heappush(self._heap, key)

    def remove(self, block_id: int) -> None:
        del self._keys[block_id]

    def pop_victim(self, now_s: float) -> int | None:
        while self._heap:
            key = heapq.heappop(self._heap)
            if self._keys.get(key[2]) == key:  # else removed or re-inserted since: a stale entry
                del self._keys[key[2]]
                return key[2]
        return None

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._keys


def replay_ceiling(requests: Sequence[TraceRequest], capacity_blocks: int, ceiling: dict) -> float:
    """Return the hit rate of :class:`KeepTimePolicy` with a ceiling's hindsight keep times, in the real pool.

    The ceiling lets the pool size average over time; a real pool is full at every instant, and a chain's head can
    go before its tail. The replay measures how much of the ceiling survives that.

    Args:
        ceiling: :func:`class_age_ceiling` of the same requests and capacity.
    """
    policy = KeepTimePolicy(ceiling["class_at"], ceiling["keep_s_by_class"])
    return simulate_policy(requests, capacity_blocks, policy).hit_rate


def fresh_return_by_feature(trace_path: Path, block_size_tokens: int = 512) -> dict:
    """Return, per feature bucket, how many fresh conversations there were and the share that came back.

    A conversation is fresh when its first full block (after the shared block 0) was never seen; it comes back
    when a later request references that block. Features: full prompt blocks, output tokens, arrival time.
    """
    rows = [json.loads(line) for line in trace_path.open(encoding="utf-8") if line.strip()]
    rows.sort(key=lambda row: row["timestamp"])
    num_refs: Counter[int] = Counter()
    full_hashes = []
    for row in rows:
        hashes = row["hash_ids"][1:]
        if row["input_length"] % block_size_tokens:
            hashes = hashes[:-1]
        full_hashes.append(hashes)
        num_refs.update(set(hashes[:1]))
    seen: set[int] = set()
    tables: dict[str, dict[str, list[int]]] = {"prompt_blocks": {}, "output_tokens": {}, "arrival_minute": {}}

    def count(feature: str, bucket: str, returned: bool) -> None:
        cell = tables[feature].setdefault(bucket, [0, 0])
        cell[0] += 1
        cell[1] += returned

    span_s = rows[-1]["timestamp"] / 1000.0 if rows else 0.0
    for row, hashes in zip(rows, full_hashes):
        if not hashes:
            continue
        if hashes[0] not in seen:
            returned = num_refs[hashes[0]] > 1
            if row["timestamp"] / 1000.0 > span_s - 1000.0:
                continue  # too close to the end of the trace to have had the time to come back
            count("prompt_blocks", _pow2_bucket(len(hashes)), returned)
            count("output_tokens", _pow2_bucket(row["output_length"]), returned)
            count("arrival_minute", f"{int(row['timestamp'] / 60000) // 10 * 10:03d}", returned)
        seen.update(hashes)
    return {feature: {bucket: {"fresh": cell[0], "returned_fraction": round(cell[1] / cell[0], 3)}
                      for bucket, cell in sorted(table.items(), key=lambda kv: _sort_key(kv[0]))}
            for feature, table in tables.items()}


def _pow2_bucket(value: int) -> str:
    bound = 1
    while bound < value:
        bound *= 2
    return f"<={bound}"


def _sort_key(bucket: str) -> int:
    digits = "".join(ch for ch in bucket if ch.isdigit())
    return int(digits) if digits else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "cachesim_headroom.json"))
    args = parser.parse_args()
    started_s = time.perf_counter()
    requests = load_trace(args.trace)
    stats = trace_stats(requests)
    uses_s = block_uses_s(requests)
    runs = []
    for fraction in FRACTIONS:
        capacity_blocks = int(fraction * stats["num_distinct_blocks"])
        belady = simulate_belady(requests, capacity_blocks).hit_rate
        entry = {"capacity_fraction": fraction, "capacity_blocks": capacity_blocks, "belady": belady}
        for policy in ("lru", "chain"):
            entry[policy] = simulate_policy(requests, capacity_blocks, policy).hit_rate
        entry["reuse_oracle"] = simulate_policy(requests, capacity_blocks, ReuseOraclePolicy(uses_s)).hit_rate
        runs.append(entry)
        print(f"{fraction:.0%}: belady {belady:.4f}  " + "  ".join(
            f"{name} {entry[name]:.4f} ({entry[name] / belady:.1%})" for name in ("lru", "chain", "reuse_oracle")))
    capacity_10 = int(0.1 * stats["num_distinct_blocks"])
    breakdown = [miss_breakdown(requests, capacity_10, policy) for policy in ("lru", "chain")]
    for result in breakdown:
        print(f"10% {result['policy']}: {result['hits']} hits, {result['misses']} misses of blocks seen before")
        for row in result["by_kind_and_idle"]:
            print(f"    {row['last_use_by']:>9} idle {row['idle_s']:>6} s: {row['hits']:6d} hits {row['misses']:6d} misses")
    ceilings = []
    for features in CEILING_FEATURES:
        ceiling = class_age_ceiling(requests, capacity_10, features)
        ceiling["replayed_hit_rate"] = replay_ceiling(requests, capacity_10, ceiling)
        del ceiling["keep_s_by_class"], ceiling["class_at"]  # tuple keys: not JSON
        ceiling["replayed_fraction_of_belady"] = ceiling["replayed_hit_rate"] / runs[-1]["belady"]
        ceilings.append(ceiling)
        print(f"10% ceiling, class = {'+'.join(ceiling['features']) or 'none'} ({ceiling['num_classes']} classes): "
              f"{ceiling['hits']:.0f} hits, {ceiling['fraction_of_reuses']:.1%} of Belady; its keep times played "
              f"in the real pool: {ceiling['replayed_fraction_of_belady']:.1%}")
    features = fresh_return_by_feature(Path(args.trace))
    for feature, table in features.items():
        print(f"fresh conversations that return, by {feature}: " + ", ".join(
            f"{bucket} {cell['returned_fraction']:.0%} (n={cell['fresh']})" for bucket, cell in table.items()))
    report = {"trace": Path(args.trace).name, **stats, "runs": runs,
              "target_hits_at_10pct": 0.85 * runs[-1]["belady"] * stats["num_block_refs"],
              "miss_breakdown_10pct": breakdown, "class_age_ceiling_10pct": ceilings,
              "fresh_return_by_feature": features,
              "elapsed_s": round(time.perf_counter() - started_s, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
