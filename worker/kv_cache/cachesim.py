"""Prefix-cache simulator: replay a trace of prompt block hashes through the real pool, prefix cache and policies.

``sluice cachesim TRACE --policy lru --policy sluice --capacity-fractions 0.05,0.1`` (the command line is
:mod:`worker.kv_cache.cachesim_cli`) replays the requests of a
JSONL trace (Mooncake format: ``timestamp`` ms, ``input_length`` tokens, ``hash_ids`` chained block hashes) in
timestamp order through :class:`~worker.kv_cache.block_pool.BlockPool`, :class:`~worker.kv_cache.prefix_cache.
PrefixCache` and the :mod:`~worker.kv_cache.eviction` policies — no model, no KV tensor — and reports each
policy's block hit rate next to Belady's MIN on the same trace and capacity. Output: a table, JSON, a PNG plot.

What one request does (the worker's semantics, with each request served instantly, one at a time)::

    hashes  h1 h2 h3 h4 h5 [p]        (the trace's hash_ids: the block shared by every request dropped; p, the
                                       prompt's partial last block, is not a reference, see below)
    cache   h1 h2 .. h4 ..            -> hits = 2: the *leading* run of cached blocks; reuse stops at the
                                         first miss (h3), so the cached h4 is recomputed and not a hit
    then    new blocks for h3 h4 h5 (and one for p) are allocated (evicting the policy's victims); h3 and h5
            enter the cache, h4's new copy stays uncached (the hash is taken), p's block is never cached; every
            block is released tail first.

Hit rate = leading-run hit blocks ÷ block references (full blocks). Capacity counts every block, in use or cached.

Partial blocks. A Mooncake ``hash_ids`` list ends with the hash of the prompt's last, partial block whenever
``input_length`` is not a multiple of the block size (12,009 of 12,031 requests). The worker hashes and caches
*full* blocks only (:func:`~worker.kv_cache.prefix_cache.hash_token_blocks`), so a prefix lookup can never hit a
partial block, and a later prompt that extends the text hashes that block's tokens differently anyway (on the
trace, 88 of 11,891 partial hashes recur, only in byte-identical repeated prompts, and none ever recurs as a full
block). So the simulator treats the partial block as the worker does: it occupies a pool block while the request
runs, is never cached, and is not a block reference — for the policies and for Belady alike, so both see the same
reference stream of full blocks. (The worker later caches that block once decode fills it with generated tokens;
the trace has no hashes of generated tokens, so neither that block nor the output blocks are simulated, for any
policy or for Belady.)

Belady's MIN (Belady 1966) here is the textbook one: the flat stream of block references (request after
request, block after block), a hit whenever the referenced block is resident, and on a miss the resident block
whose next reference is furthest in the future is evicted — or the new block is not kept at all when its own next
reference is the furthest (bypass). Leading-run hits of any policy are at most its any-resident hits, which are
at most MIN's, so MIN is an upper bound for every policy simulated here (and on the Mooncake conversation trace it
reaches the compulsory-miss bound, ``1 - distinct / references``, from 5% capacity up).

Tiers: each conversation (its first block hash after the shared one) is hashed to a tier by a stated mix
(default vip 20% / standard 60% / free 20%, priorities 2 / 1 / 0), so the ``tier`` policy has labels and every
policy reports a hit rate per tier. The ``ttl`` policy's requests carry a retention per tier (default vip 1200 s,
standard 600 s, free 300 s); the other policies' requests carry none (the worker's default, ``default_cache_ttl_s =
0``), which matters to ``adaptive``, the other policy that evicts a block whose retention is over first.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.kv_cache.block_pool import BlockPool
from worker.kv_cache.eviction import BlockMeta, EvictionPolicy, make_policy
from worker.kv_cache.prefix_cache import PrefixCache

DEFAULT_FRACTIONS = (0.05, 0.1, 0.25, 0.5)
DEFAULT_TIER_MIX = (("vip", 2, 20), ("standard", 1, 60), ("free", 0, 20))  # (name, priority, percent)
DEFAULT_TTL_S_BY_TIER = {"vip": 1200.0, "standard": 600.0, "free": 300.0}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, as the cache sees it.

    Attributes:
        arrival_s: arrival time, seconds from the trace start.
        block_hashes: ``[num_full_blocks]`` chained hashes of the prompt's *full* blocks (the shared first block
            dropped): the block references a prefix cache can serve.
        last_block_partial: the prompt also has a partial last block (fewer than ``block_size_tokens`` tokens),
            which takes a pool block while the request runs but is never cached (its hash is not in
            ``block_hashes``).
        tier: tier label; tier_priority: its priority (larger = more important).
    """

    arrival_s: float
    block_hashes: tuple[int, ...]
    last_block_partial: bool
    tier: str = "standard"
    tier_priority: int = 1


@dataclass
class SimResult:
    """Hits and references of one replay, in blocks, overall and per tier."""

    name: str
    num_hit_blocks: int = 0
    num_block_refs: int = 0
    num_evictions: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    refs_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_block_refs if self.num_block_refs else 0.0

    def hit_rate_by_tier(self) -> dict[str, float]:
        return {tier: self.hits_by_tier.get(tier, 0) / refs for tier, refs in sorted(self.refs_by_tier.items())
                if refs}

    def count(self, tier: str, num_hits: int, num_refs: int) -> None:
        self.num_hit_blocks += num_hits
        self.num_block_refs += num_refs
        self.hits_by_tier[tier] = self.hits_by_tier.get(tier, 0) + num_hits
        self.refs_by_tier[tier] = self.refs_by_tier.get(tier, 0) + num_refs


def tier_of(conversation_hash: int, tier_mix: Sequence[tuple[str, int, int]]) -> tuple[str, int]:
    """Map a conversation to a tier, deterministically: BLAKE2b of its first block hash, mod 100, into the mix.

    Args:
        conversation_hash: the conversation's first block hash.
        tier_mix: ``(name, priority, percent)`` entries whose percents sum to 100.
    """
    digest = hashlib.blake2b(str(conversation_hash).encode(), digest_size=8).digest()
    slot = int.from_bytes(digest, "little") % 100
    for name, priority, percent in tier_mix:
        if slot < percent:
            return name, priority
        slot -= percent
    name, priority, _ = tier_mix[-1]
    return name, priority


def _parse_trace_line(line: str, where: str) -> dict:
    """Parse one JSONL line into a request row, or raise ValueError naming ``where`` (file:line)."""
    expected = 'expected a Mooncake JSONL request: {"timestamp": ms, "input_length": tokens, "hash_ids": [ints]}'
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg}); {expected}") from None
    if not isinstance(row, dict) or "hash_ids" not in row or "timestamp" not in row:
        raise ValueError(f"{where}: a request needs 'timestamp' and 'hash_ids'; {expected}")
    if not isinstance(row["timestamp"], (int, float)):
        raise ValueError(f"{where}: 'timestamp' must be a number (ms), got {row['timestamp']!r}")
    if not isinstance(row["hash_ids"], list) or not all(isinstance(h, int) for h in row["hash_ids"]):
        raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
    if not isinstance(row.get("input_length", 0), int) or row.get("input_length", 0) < 0:
        raise ValueError(f"{where}: 'input_length' must be an integer ≥ 0 (tokens), got {row['input_length']!r}")
    return row


def load_trace(path: str | Path, block_size_tokens: int = 512, drop_shared_first_block: bool = True,
               tier_mix: Sequence[tuple[str, int, int]] = DEFAULT_TIER_MIX,
               max_requests: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace into requests sorted by arrival (stable for equal timestamps).

    The hash of a prompt's partial last block (``input_length`` not a multiple of ``block_size_tokens``) is left
    out of ``block_hashes`` and flagged in ``last_block_partial`` (see the module docstring). A request left with
    no full block (a prompt within the shared first block and a partial one) is skipped.

    Args:
        path: the JSONL file.
        block_size_tokens: tokens per hashed block of the trace (512 for Mooncake).
        drop_shared_first_block: drop ``hash_ids[0]`` when every request starts with the same hash (Mooncake's
            block 0, shared by every request, is left out of the measurement).
        tier_mix: see :func:`tier_of`.
        max_requests: keep only the first requests (a slice for tests); None = all.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line that is not a request (JSON object with a numeric ``timestamp`` and a list of integer
            ``hash_ids``; the message names file and line), a file that is not UTF-8 text, a tier mix that does
            not sum to 100, ``block_size_tokens`` < 1 or ``max_requests`` < 1.
    """
    if sum(percent for _, _, percent in tier_mix) != 100:
        raise ValueError(f"tier mix percents must sum to 100: {list(tier_mix)}")
    if block_size_tokens < 1:
        raise ValueError(f"block_size_tokens must be ≥ 1, got {block_size_tokens}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be ≥ 1 (or None for all), got {max_requests}")
    rows = []
    with open(path, encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rows.append(_parse_trace_line(line, f"{path}:{line_no}"))
                if max_requests is not None and len(rows) >= max_requests:
                    break
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text (expected a Mooncake JSONL trace)") from None
    rows.sort(key=lambda row: row["timestamp"])
    firsts = {row["hash_ids"][0] for row in rows if row["hash_ids"]}
    drop = drop_shared_first_block and len(firsts) == 1 and all(row["hash_ids"] for row in rows)
    requests = []
    for row in rows:
        input_length = row.get("input_length", len(row["hash_ids"]) * block_size_tokens)
        partial = input_length % block_size_tokens != 0
        hash_ids = row["hash_ids"][:-1] if partial else row["hash_ids"]
        hashes = tuple(hash_ids[1:] if drop else hash_ids)
        if not hashes:
            continue
        tier, priority = tier_of(hashes[0], tier_mix)
        requests.append(TraceRequest(arrival_s=row["timestamp"] / 1000.0, block_hashes=hashes,
                                     last_block_partial=partial, tier=tier, tier_priority=priority))
    return requests


class PrefixCacheSim:
    """Drive the real :class:`BlockPool` + :class:`PrefixCache` + an :class:`EvictionPolicy` with trace requests.

    Blocks carry no token ids (the trace has none): the prefix cache's content check compares the chained parent
    hash and an empty token tuple, so a hit still requires the same parent chain.

    Args:
        capacity_blocks: blocks in the pool.
        policy: the eviction policy (a fresh one per simulation).
        ttl_s_by_tier: retention per tier in seconds for ``BlockMeta.expires_at_s``; missing tiers never expire.
    """

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy,
                 ttl_s_by_tier: dict[str, float] | None = None) -> None:
        self.now_s = 0.0
        self.prefix_cache = PrefixCache()
        self.pool = BlockPool(capacity_blocks, policy, clock=lambda: self.now_s,
                              on_evict=lambda block_id, block_hash: self.prefix_cache.remove(block_id, block_hash))
        self.ttl_s_by_tier = dict(ttl_s_by_tier or {})

    def access(self, request: TraceRequest) -> int:
        """Serve one request instantly; return how many leading blocks it found in the cache."""
        self.now_s = request.arrival_s
        hashes = request.block_hashes
        hit_block_ids: list[int] = []
        parent: int | None = None
        for block_hash in hashes:
            block_id = self.prefix_cache.get(block_hash, parent, ())
            if block_id is None:
                break
            hit_block_ids.append(block_id)
            parent = block_hash
        self.pool.touch(hit_block_ids)
        num_hits = len(hit_block_ids)
        new_block_ids = self.pool.allocate(len(hashes) - num_hits + request.last_block_partial)
        if new_block_ids is None:  # the prompt alone exceeds the pool: served uncached
            self.pool.free(reversed(hit_block_ids))
            return num_hits
        table = hit_block_ids + new_block_ids  # [num_full_blocks (+ 1 partial, never cached)]
        expires_at_s = self.now_s + self.ttl_s_by_tier.get(request.tier, float("inf"))
        for block_idx in range(num_hits, len(hashes)):
            parent = hashes[block_idx - 1] if block_idx else None
            block_id = table[block_idx]
            if self.prefix_cache.insert(hashes[block_idx], parent, (), block_id):
                self.pool.mark_cached(block_id, BlockMeta(block_hash=hashes[block_idx], block_idx=block_idx))
        last_idx = len(hashes) - 1
        for block_idx, block_id in enumerate(table):
            meta = self.pool.meta(block_id)
            if meta is None:
                continue
            meta.tier = request.tier
            meta.tier_priority = request.tier_priority
            meta.expires_at_s = expires_at_s
            meta.last_access_s = self.now_s
            meta.is_chain_tail = block_idx == last_idx
            meta.is_partial = False  # the partial block is never cached here (see the module docstring)
            meta.num_request_blocks = len(table)  # as the worker counts: ceil(prompt tokens / block size)
            meta.num_request_cached_blocks = num_hits
        self.pool.free(reversed(table))
        return num_hits


def _check_capacity(capacity_blocks: int) -> None:
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be ≥ 1, got {capacity_blocks}")


def simulate_policy(requests: Sequence[TraceRequest], capacity_blocks: int, policy: str | EvictionPolicy,
                    ttl_s_by_tier: dict[str, float] | None = None) -> SimResult:
    """Replay ``requests`` through a pool of ``capacity_blocks`` with ``policy``; return hits per tier.

    Raises:
        ValueError: ``capacity_blocks`` < 1, or an unknown policy name (the message lists the valid ones).
    """
    _check_capacity(capacity_blocks)
    policy_obj = make_policy(policy) if isinstance(policy, str) else policy
    sim = PrefixCacheSim(capacity_blocks, policy_obj,
                         DEFAULT_TTL_S_BY_TIER if ttl_s_by_tier is None else ttl_s_by_tier)
    result = SimResult(name=policy_obj.name)
    for request in requests:
        result.count(request.tier, sim.access(request), len(request.block_hashes))
    result.num_evictions = sim.pool.num_evictions
    return result


def simulate_belady(requests: Sequence[TraceRequest], capacity_blocks: int) -> SimResult:
    """Belady's MIN with bypass over the flat block reference stream (see the module docstring).

    Raises:
        ValueError: ``capacity_blocks`` < 1.
    """
    _check_capacity(capacity_blocks)
    stream = [block_hash for request in requests for block_hash in request.block_hashes]
    never = len(stream)
    next_use = [never] * len(stream)
    last_seen: dict[int, int] = {}
    for pos in range(len(stream) - 1, -1, -1):
        next_use[pos] = last_seen.get(stream[pos], never)
        last_seen[stream[pos]] = pos
    resident: dict[int, int] = {}  # block hash -> its next use
    furthest: list[tuple[int, int]] = []  # (-next use, block hash), lazy deletion
    result = SimResult(name="belady")
    pos = 0
    for request in requests:
        num_hits = 0
        for block_hash in request.block_hashes:
            nxt = next_use[pos]
            pos += 1
            if block_hash in resident:
                num_hits += 1
            elif len(resident) >= capacity_blocks:
                while -furthest[0][0] != resident.get(furthest[0][1]):
                    heapq.heappop(furthest)
                if -furthest[0][0] <= nxt:  # the new block is needed last: do not keep it
                    continue
                _, victim = heapq.heappop(furthest)
                del resident[victim]
                result.num_evictions += 1
            resident[block_hash] = nxt
            heapq.heappush(furthest, (-nxt, block_hash))
        result.count(request.tier, num_hits, len(request.block_hashes))
    return result


def trace_stats(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Return references, distinct blocks and the compulsory-miss bound on the hit rate."""
    num_refs = sum(len(request.block_hashes) for request in requests)
    num_distinct = len({block_hash for request in requests for block_hash in request.block_hashes})
    return {"num_requests": len(requests), "num_block_refs": num_refs, "num_distinct_blocks": num_distinct,
            "compulsory_bound_hit_rate": (num_refs - num_distinct) / num_refs if num_refs else 0.0}


def compare(requests: Sequence[TraceRequest], capacities_blocks: Sequence[int], policies: Sequence[str],
            ttl_s_by_tier: dict[str, float] | None = None) -> list[dict]:
    """Run every policy and Belady at every capacity; return one JSON-ready dict per capacity."""
    num_distinct = trace_stats(requests)["num_distinct_blocks"]
    runs = []
    for capacity_blocks in capacities_blocks:
        belady = simulate_belady(requests, capacity_blocks)
        entry = {"capacity_blocks": capacity_blocks,
                 "capacity_fraction": capacity_blocks / num_distinct if num_distinct else 0.0,
                 "belady": {"hit_rate": belady.hit_rate, "hit_rate_by_tier": belady.hit_rate_by_tier()},
                 "policies": {}}
        for name in policies:
            result = simulate_policy(requests, capacity_blocks, name, ttl_s_by_tier if name == "ttl" else {})
            entry["policies"][name] = {
                "hit_rate": result.hit_rate,
                "fraction_of_belady": result.hit_rate / belady.hit_rate if belady.hit_rate else 0.0,
                "hit_rate_by_tier": result.hit_rate_by_tier(),
                "num_evictions": result.num_evictions,
            }
        runs.append(entry)
    return runs


def format_table(runs: Sequence[dict]) -> str:
    """Render hit rates (and fraction of Belady) as a fixed-width text table."""
    names = list(runs[0]["policies"]) if runs else []
    header = f"{'capacity':>16} {'belady':>7} " + " ".join(f"{name:>17}" for name in names)
    lines = [header]
    for entry in runs:
        cells = [f"{entry['policies'][name]['hit_rate']:.4f} ({entry['policies'][name]['fraction_of_belady']:.1%})"
                 for name in names]
        capacity = f"{entry['capacity_blocks']} ({entry['capacity_fraction']:.0%})"
        lines.append(f"{capacity:>16} {entry['belady']['hit_rate']:7.4f} " + " ".join(f"{c:>17}" for c in cells))
    return "\n".join(lines)


def plot(runs: Sequence[dict], out_path: str | Path, title: str = "prefix cache hit rate") -> None:
    """Write a PNG: hit rate vs capacity (left) and fraction of Belady (right) for every policy.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'sluice[sim]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as exc:
        raise RuntimeError("the plot needs matplotlib: pip install 'sluice[sim]'") from exc
    xs = [100 * entry["capacity_fraction"] for entry in runs]
    fig, (ax_rate, ax_frac) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_rate.plot(xs, [entry["belady"]["hit_rate"] for entry in runs], "k--", marker="o", label="Belady MIN")
    for name in runs[0]["policies"]:
        ax_rate.plot(xs, [entry["policies"][name]["hit_rate"] for entry in runs], marker="o", label=name)
        ax_frac.plot(xs, [100 * entry["policies"][name]["fraction_of_belady"] for entry in runs], marker="o",
                     label=name)
    ax_rate.set(xlabel="capacity (% of distinct blocks)", ylabel="block hit rate", title=title)
    ax_frac.set(xlabel="capacity (% of distinct blocks)", ylabel="% of Belady's hit rate",
                title="fraction of the offline optimum")
    for ax in (ax_rate, ax_frac):
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(xs, [f"{x:.3g}" for x in xs])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def split_by_time(requests: Sequence[TraceRequest]) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """Split a trace at the midpoint of its arrival times: (first half, second half) by time, not by count.

    The first half is for choosing a policy's parameters, the second for reporting: a result on the second half
    was not fitted to it.
    """
    if not requests:
        return [], []
    mid_s = (min(r.arrival_s for r in requests) + max(r.arrival_s for r in requests)) / 2
    return ([r for r in requests if r.arrival_s < mid_s], [r for r in requests if r.arrival_s >= mid_s])
