"""What KV lifetime is worth end to end: returning chats against ``sluice serve`` on the CPU, offload tiers off /
host RAM / host RAM + disk, with a device pool deliberately too small for the conversations in flight.

The servers hold float32 weights (the CPU kernels of the quantized ones are far slower at prefill). Workload: the
Mooncake conversation trace's prefix structure (``../shared/data/mooncake_fast25``) turned into text.
The first ``--conversations`` conversations (a conversation = the requests sharing the first block after the block
every request shares) with at least two turns are replayed in trace order, interleaved as in the trace, one request
at a time (time compressed: the order is what matters for the cache). Each trace block becomes
``--words-per-block`` deterministic words (seeded by the block hash), so two prompts share text exactly where the
trace's prompts share blocks; prompts are cut to ``--max-blocks`` blocks to fit the CPU model's context. A request is
a *returning turn* when an earlier request of its conversation was replayed.

Every configuration of a part runs as its own server at the same time, and the servers take turns: the requests are
cut into rounds of ``--round-requests``; each round is sent to every server in turn, one request at a time, the
order of the servers rotated from round to round (A B, B A, A B, … for two), with ``--settle-s`` of quiet after each
server's round so that its background work (disk and Redis writers) is done before the next server starts. Each
server sees the same requests in the same order, so its cache behaves as in a run of its own, while a change of the
machine's load over the minutes of a run falls on every configuration alike.

Part ``returning`` (tiers off / host RAM / host RAM + disk): TTFT p50 / p99 of returning turns and of first turns
(client side, streaming ``/v1/completions``, 4 output tokens), prefill tokens saved
(``usage.prompt_tokens_details.cached_tokens`` ÷ prompt tokens), and prefix hit tokens per storage tier
(``sluice_worker_kv_prefix_hit_tokens_total{tier}``).

Part ``miss_penalty`` (tiers off / host RAM + disk / host RAM + disk + Redis): the first ``--miss-requests`` of
the same prompt lengths with every prompt unique (nothing returns; a fresh salt per run, so nothing a previous run left in Redis is found), so the tiers
only cost: demotion copies and background writes. Per tiers-on configuration against tiers off:
``ttft_p50`` = TTFT p50 (on) / TTFT p50 (off) − 1, ``ttft_paired_median`` = median over prompts of TTFT (on) /
TTFT (off) − 1 (the same prompt on both servers, a round apart), ``busy_time`` = summed request latency (on) /
(off) − 1 (the throughput cost of serving one request at a time), and ``cpu_s`` = CPU seconds of the server's
processes (all threads, writers included, read from ``/proc``) (on) / (off) − 1. The LMCache evaluation measured
−3% to −15% there; the target is ≤ 3%.

Writes ``bench/results/returning_chat.json`` (a part run alone replaces its own part of the file). Others' load on
the machine still adds noise to every number: run it on a quiet machine.

    .venv/bin/python bench/returning_chat_bench.py [--part returning|miss_penalty|all] [--conversations 24]
        [--max-turns 4] [--threads 2] [--round-requests 8] [--miss-requests 48] [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from bench.common import RESULTS_DIR, SHARED_DATA, SluiceProcess, percentile, sse_chunks, write_result  # noqa: E402
from worker.kv_cache.cachesim import TraceRequest, load_trace  # noqa: E402

TRACE = SHARED_DATA / "mooncake_fast25" / "conversation_trace.jsonl"
VOCABULARY = ("time year people way day man thing woman life child world school state family student group country "
              "problem hand part place case week company system program question work government number night point "
              "home water room mother area money story fact month lot right study book eye job word business issue "
              "side kind head house service friend father power hour game line end member law car city community "
              "name president team minute idea kid body information back parent face others level office door "
              "health person art war history party result change morning reason research girl guy moment air "
              "teacher force education").split()
OUTPUT_TOKENS = 4
SERVER_CONFIG = """
[model]
max_model_len_tokens = 2048
weights = "float32"
[gateway]
max_tokens_cap = 64
[worker]
backend = "cpu"
kv_cache_gib = {kv_cache_gib}
block_size_tokens = 16
max_num_seqs = 4
max_num_batched_tokens = 2048
num_threads = {threads}
[kv]
eviction_policy = "{policy}"
host_cache_gib = {host_cache_gib}
disk_cache_gib = {disk_cache_gib}
disk_cache_dir = "{disk_cache_dir}"
redis_url = "{redis_url}"
redis_cache_gib = {redis_cache_gib}
redis_ttl_s = 600
swap_space_gib = 0
"""
TIER_CONFIGS = {  # name -> (host_cache_gib, disk_cache_gib, redis_cache_gib)
    "tiers_off": (0.0, 0.0, 0.0),
    "host": (0.25, 0.0, 0.0),
    "host_disk": (0.04, 1.0, 0.0),
    "host_disk_redis": (0.04, 0.1, 1.0),
}
PARTS = {  # part -> the configurations it compares, the baseline first
    "returning": ("tiers_off", "host", "host_disk"),
    "miss_penalty": ("tiers_off", "host_disk", "host_disk_redis"),
}
RESULT_NAME = "returning_chat"


def block_text(block_hash: int, words_per_block: int) -> str:
    """Deterministic words for one trace block (the same hash gives the same text)."""
    rng = random.Random(block_hash)
    return " ".join(rng.choice(VOCABULARY) for _ in range(words_per_block))


def select_conversations(requests: list[TraceRequest], num_conversations: int,
                         max_turns: int) -> list[tuple[TraceRequest, bool]]:
    """Return the replay: (request, is_returning_turn) in trace order, for the first conversations with ≥ 2 turns."""
    turns: dict[int, list[TraceRequest]] = {}
    for request in requests:
        turns.setdefault(request.block_hashes[0], []).append(request)
    roots = [root for root, reqs in turns.items() if len(reqs) >= 2][:num_conversations]
    chosen = sorted((request for root in roots for request in turns[root][:max_turns]),
                    key=lambda request: request.arrival_s)
    seen: set[int] = set()
    replay = []
    for request in chosen:
        replay.append((request, request.block_hashes[0] in seen))
        seen.add(request.block_hashes[0])
    return replay


async def complete(session: aiohttp.ClientSession, base_url: str, prompt: str) -> dict:
    """Stream one completion; return TTFT and latency (ms), prompt and cached tokens."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start_s = time.perf_counter()
    ttft_ms, usage = None, {}
    async with session.post(base_url + "/v1/completions", json=body) as response:
        if response.status != 200:  # counted, not fatal: the other servers' turns go on
            return {"ttft_ms": None, "latency_ms": (time.perf_counter() - start_s) * 1000, "prompt_tokens": 0,
                    "cached_tokens": 0, "error": f"{response.status} {(await response.text())[:200]}"}
        async for chunk in sse_chunks(response):
            if ttft_ms is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft_ms = (time.perf_counter() - start_s) * 1000
            usage = chunk.get("usage") or usage
    return {"ttft_ms": ttft_ms, "latency_ms": (time.perf_counter() - start_s) * 1000,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def kv_counters(base_url: str) -> dict[str, float]:
    """Prefix hit tokens per storage tier and prefix query tokens, summed over workers, from ``/metrics``."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("sluice_worker_kv_prefix_hit_tokens_total", "sluice_worker_kv_prefix_query_tokens_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                key = name.removeprefix("sluice_worker_kv_").removesuffix("_total")
                if 'tier="' in line:
                    key += ":" + line.split('tier="')[1].split('"')[0]
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def session_cpu_s(session_id: int) -> float:
    """CPU seconds (user + system, all threads) of the live processes of one session (a server and its workers)."""
    total_ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id:  # fields after the name: state ppid pgrp session … utime(11) stime(12)
            total_ticks += int(fields[11]) + int(fields[12])
    return total_ticks / os.sysconf("SC_CLK_TCK")


async def interleaved_replay(servers: dict[str, SluiceProcess], prompts: list[tuple[str, bool]], round_requests: int,
                             settle_s: float) -> dict[str, dict]:
    """Send every round of ``prompts`` to every server in turn (order rotated per round), one request at a time.

    Returns:
        Per server: ``results`` (one dict per prompt, in order) and ``cpu_s`` (its processes' CPU seconds over its
        rounds, each measured from before its first request to after its settle time).
    """
    names = list(servers)
    out = {name: {"results": [], "cpu_s": 0.0} for name in names}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for server in servers.values():
            await complete(session, server.base_url, "warm up " * 8)
        for round_idx, start in enumerate(range(0, len(prompts), round_requests)):
            shift = round_idx % len(names)
            for name in names[shift:] + names[:shift]:
                cpu_before_s = session_cpu_s(servers[name].process.pid)
                for prompt, returning in prompts[start:start + round_requests]:
                    result = await complete(session, servers[name].base_url, prompt)
                    out[name]["results"].append({**result, "returning": returning, "round": round_idx})
                    if result.get("error"):
                        print(f"{name}: {result['error']}\n{servers[name].log_text()[-3000:]}", flush=True)
                await asyncio.sleep(settle_s)
                out[name]["cpu_s"] += session_cpu_s(servers[name].process.pid) - cpu_before_s
                ttfts_ms = [r["ttft_ms"] for r in out[name]["results"] if r["round"] == round_idx and r["ttft_ms"]]
                print(f"round {round_idx} {name}: TTFT p50 {percentile(ttfts_ms, 50):.0f} ms", flush=True)
    return out


def summarize(results: list[dict], counters: dict[str, float]) -> dict:
    def ttfts(returning: bool | None) -> list[float]:
        return [r["ttft_ms"] for r in results if r["ttft_ms"] is not None
                and (returning is None or r["returning"] == returning)]

    def rounded(value: float) -> float | None:
        return None if math.isnan(value) else round(value, 1)

    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    query_tokens = counters.get("prefix_query_tokens", 0.0)
    busy_s = sum(r["latency_ms"] for r in results) / 1000
    return {
        "num_requests": len(results),
        "num_returning": sum(r["returning"] for r in results),
        "num_errors": sum(bool(r.get("error")) for r in results),
        "ttft_ms_returning_p50": rounded(percentile(ttfts(True), 50)),
        "ttft_ms_returning_p99": rounded(percentile(ttfts(True), 99)),
        "ttft_ms_first_turn_p50": rounded(percentile(ttfts(False), 50)),
        "ttft_ms_all_p50": rounded(percentile(ttfts(None), 50)),
        "ttft_ms_all_p99": rounded(percentile(ttfts(None), 99)),
        "busy_s": round(busy_s, 2),
        "prompt_tokens_per_busy_s": round(prompt_tokens / busy_s, 1) if busy_s else None,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_saved": sum(r["cached_tokens"] for r in results),
        "prefill_saved_fraction": round(sum(r["cached_tokens"] for r in results) / prompt_tokens, 4)
        if prompt_tokens else 0.0,
        "hit_rate_by_tier": {key.split(":")[1]: round(value / query_tokens, 4)
                             for key, value in sorted(counters.items()) if ":" in key and query_tokens},
    }


def run_part(part: str, prompts: list[tuple[str, bool]], args: argparse.Namespace) -> dict[str, dict]:
    """Serve ``prompts`` on one server per configuration of ``part`` at once, interleaved; summary per config."""
    names = [name for name in PARTS[part] if TIER_CONFIGS[name][2] == 0 or args.redis_url]
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in names:
            host_gib, disk_gib, redis_gib = TIER_CONFIGS[name]
            disk_dir = stack.enter_context(tempfile.TemporaryDirectory())
            config = SERVER_CONFIG.format(kv_cache_gib=args.kv_cache_gib, threads=args.threads, policy=args.policy,
                                          host_cache_gib=host_gib, disk_cache_gib=disk_gib, disk_cache_dir=disk_dir,
                                          redis_url=args.redis_url if redis_gib else "", redis_cache_gib=redis_gib)
            server = SluiceProcess(config, min_ready_workers=1, start_timeout_s=600, inherit_sluice_env=True)
            stack.callback(server.close)
            servers[name] = server.start(wait=False)  # the servers load their models at the same time
        for server in servers.values():
            server.wait_ready()
        print(f"{part}: servers ready", flush=True)
        started_s = time.perf_counter()
        replayed = asyncio.run(interleaved_replay(servers, prompts, args.round_requests, args.settle_s))
        summaries = {}
        for name in names:
            summary = summarize(replayed[name]["results"], kv_counters(servers[name].base_url))
            summary.update(config=name, host_cache_gib=TIER_CONFIGS[name][0], disk_cache_gib=TIER_CONFIGS[name][1],
                           redis_cache_gib=TIER_CONFIGS[name][2], cpu_s=round(replayed[name]["cpu_s"], 2))
            summaries[name] = summary
            print(json.dumps(summary), flush=True)
    penalties = {name: penalty(replayed[names[0]], replayed[name]) for name in names[1:]}
    return {"configs": summaries, "penalty_vs_" + names[0]: penalties,
            "wall_s": round(time.perf_counter() - started_s, 1), "load_average_1m_after": round(os.getloadavg()[0], 2)}


def penalty(off: dict, on: dict) -> dict[str, float]:
    """What ``on`` costs against ``off`` (same prompts, same order): relative TTFT p50, paired TTFT, busy time, CPU."""
    pairs = [(a["ttft_ms"], b["ttft_ms"]) for a, b in zip(off["results"], on["results"])
             if a["ttft_ms"] and b["ttft_ms"]]
    busy_off_s, busy_on_s = (sum(r["latency_ms"] for r in side["results"]) for side in (off, on))
    return {
        "ttft_p50": round(percentile([b for _, b in pairs], 50) / percentile([a for a, _ in pairs], 50) - 1, 4),
        "ttft_paired_median": round(statistics.median(b / a for a, b in pairs) - 1, 4),
        "busy_time": round(busy_on_s / busy_off_s - 1, 4),
        "cpu_s": round(on["cpu_s"] / off["cpu_s"] - 1, 4) if off["cpu_s"] else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--words-per-block", type=int, default=16)
    parser.add_argument("--max-blocks", type=int, default=48)
    parser.add_argument("--kv-cache-gib", type=float, default=0.06, help="device pool (deliberately small)")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--round-requests", type=int, default=8, help="requests per server turn")
    parser.add_argument("--settle-s", type=float, default=0.5, help="quiet after each server's turn, seconds")
    parser.add_argument("--miss-requests", type=int, default=48, help="requests of the miss_penalty part")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help='"" leaves the Redis config out')
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout stops the servers on the way out
    chosen = select_conversations(load_trace(TRACE), args.conversations, args.max_turns)
    prompts = {
        "returning": [(" ".join(block_text(h, args.words_per_block) for h in request.block_hashes[:args.max_blocks]),
                       returning) for request, returning in chosen],
    }
    salt = random.randrange(2**32)
    prompts["miss_penalty"] = [(" ".join(block_text(hash((salt, i, j)), args.words_per_block)
                                         for j in range(min(len(request.block_hashes), args.max_blocks))), False)
                               for i, (request, _) in enumerate(chosen)][:args.miss_requests]
    path = RESULTS_DIR / f"{RESULT_NAME}.json"
    result = json.loads(path.read_text()) if path.exists() and args.part != "all" else {}
    result.update({
        "trace": TRACE.name, "conversations": args.conversations, "max_turns": args.max_turns,
        "words_per_block": args.words_per_block, "max_blocks": args.max_blocks,
        "kv_cache_gib": args.kv_cache_gib, "policy": args.policy, "threads": args.threads,
        "output_tokens": OUTPUT_TOKENS, "round_requests": args.round_requests, "settle_s": args.settle_s,
        "miss_requests": args.miss_requests,
        "note": "one request at a time, the configurations' servers taking turns by round; a shared 2-core machine",
    })
    for part in (PARTS if args.part == "all" else (args.part,)):
        started_s = time.perf_counter()
        result[part] = run_part(part, prompts[part], args)
        print(f"{part}: {time.perf_counter() - started_s:.0f} s", flush=True)
    stale = {"returning": ("returning_chats",), "miss_penalty": ("nothing_returns", "miss_penalty_ttft_p50_tiers_on")}
    for part, keys in stale.items():  # the layout before the parts, with configurations run one after another
        for key in keys if part in result else ():
            result.pop(key, None)
    result.pop("elapsed_s", None)
    write_result(RESULT_NAME, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
