"""What KV lifetime is worth end to end: returning chats against ``sluice serve`` on the CPU, offload tiers off /
host RAM / host RAM + disk, with a device pool deliberately too small for the conversations in flight.

Workload: the Mooncake conversation trace's prefix structure (``../shared/data/mooncake_fast25``) turned into text.
The first ``--conversations`` conversations (a conversation = the requests sharing the first block after the block
every request shares) with at least two turns are replayed in trace order, interleaved as in the trace, one request
at a time (time compressed: the order is what matters for the cache). Each trace block becomes
``--words-per-block`` deterministic words (seeded by the block hash), so two prompts share text exactly where the
trace's prompts share blocks; prompts are cut to ``--max-blocks`` blocks to fit the CPU model's context. A request is
a *returning turn* when an earlier request of its conversation was replayed.

Per configuration (a fresh server each): TTFT p50 / p99 of returning turns and of first turns (client side,
streaming ``/v1/completions``, 4 output tokens), prefill tokens saved (``usage.prompt_tokens_details.cached_tokens``
÷ prompt tokens), and prefix hit tokens per storage tier (``sluice_worker_kv_prefix_hit_tokens{tier}``).
Miss penalty: the same prompt lengths with every prompt unique (nothing returns), tiers off vs host RAM + disk:
``TTFT p50 (tiers on) / TTFT p50 (tiers off) - 1`` (the LMCache evaluation measured -3% to -15% there).

Writes ``bench/results/returning_chat.json``. Others' load on the machine shows up in every number: run it on a
quiet machine and compare configurations within one run only (each configuration records the 1-minute load average
when it ends).

    .venv/bin/python bench/returning_chat_bench.py [--conversations 24] [--max-turns 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from bench.common import SHARED_DATA, percentile, sluice_server, sse_chunks, write_result  # noqa: E402
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
swap_space_gib = 0
"""
TIER_CONFIGS = {  # name -> (host_cache_gib, disk_cache_gib)
    "tiers_off": (0.0, 0.0),
    "host": (0.25, 0.0),
    "host_disk": (0.04, 1.0),
}


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
    """Stream one completion; return TTFT (ms), prompt and cached tokens."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start_s = time.perf_counter()
    ttft_ms, usage = None, {}
    async with session.post(base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in sse_chunks(response):
            if ttft_ms is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft_ms = (time.perf_counter() - start_s) * 1000
            usage = chunk.get("usage") or usage
    return {"ttft_ms": ttft_ms, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def kv_counters(base_url: str) -> dict[str, float]:
    """Prefix hit tokens per storage tier and prefix query tokens, summed over workers, from ``/metrics``."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("sluice_worker_kv_prefix_hit_tokens", "sluice_worker_kv_prefix_query_tokens"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                key = name.removeprefix("sluice_worker_kv_")
                if 'tier="' in line:
                    key += ":" + line.split('tier="')[1].split('"')[0]
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def replay(base_url: str, prompts: list[tuple[str, bool]]) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await complete(session, base_url, "warm up " * 8)
        results = []
        for prompt, returning in prompts:
            results.append({**await complete(session, base_url, prompt), "returning": returning})
        return results


def summarize(results: list[dict], counters: dict[str, float]) -> dict:
    def ttfts(returning: bool | None) -> list[float]:
        return [r["ttft_ms"] for r in results if r["ttft_ms"] is not None
                and (returning is None or r["returning"] == returning)]

    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    query_tokens = counters.get("prefix_query_tokens", 0.0)
    return {
        "num_requests": len(results),
        "num_returning": sum(r["returning"] for r in results),
        "ttft_ms_returning_p50": round(percentile(ttfts(True), 50), 1),
        "ttft_ms_returning_p99": round(percentile(ttfts(True), 99), 1),
        "ttft_ms_first_turn_p50": round(percentile(ttfts(False), 50), 1),
        "ttft_ms_all_p50": round(percentile(ttfts(None), 50), 1),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_saved": sum(r["cached_tokens"] for r in results),
        "prefill_saved_fraction": round(sum(r["cached_tokens"] for r in results) / prompt_tokens, 4)
        if prompt_tokens else 0.0,
        "hit_rate_by_tier": {key.split(":")[1]: round(value / query_tokens, 4)
                             for key, value in sorted(counters.items()) if ":" in key and query_tokens},
    }


def run_config(name: str, prompts: list[tuple[str, bool]], args: argparse.Namespace) -> dict:
    host_gib, disk_gib = TIER_CONFIGS[name]
    with tempfile.TemporaryDirectory() as disk_dir:
        config = SERVER_CONFIG.format(kv_cache_gib=args.kv_cache_gib, threads=args.threads, policy=args.policy,
                                      host_cache_gib=host_gib, disk_cache_gib=disk_gib, disk_cache_dir=disk_dir)
        with sluice_server(config) as base_url:
            started_s = time.perf_counter()
            results = asyncio.run(replay(base_url, prompts))
            summary = summarize(results, kv_counters(base_url))
    summary.update(config=name, host_cache_gib=host_gib, disk_cache_gib=disk_gib,
                   wall_s=round(time.perf_counter() - started_s, 1),
                   load_average_1m_after=round(os.getloadavg()[0], 2))
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--words-per-block", type=int, default=16)
    parser.add_argument("--max-blocks", type=int, default=48)
    parser.add_argument("--kv-cache-gib", type=float, default=0.06, help="device pool (deliberately small)")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    chosen = select_conversations(load_trace(TRACE), args.conversations, args.max_turns)
    prompts = [(" ".join(block_text(h, args.words_per_block) for h in request.block_hashes[:args.max_blocks]),
                returning) for request, returning in chosen]
    unique = [(" ".join(block_text(-(i * 1000 + j) - 1, args.words_per_block)
                        for j in range(min(len(request.block_hashes), args.max_blocks))), False)
              for i, (request, _) in enumerate(chosen)]
    started_s = time.perf_counter()
    configs = {name: run_config(name, prompts, args) for name in TIER_CONFIGS}
    no_return = {name: run_config(name, unique, args) for name in ("tiers_off", "host_disk")}
    penalty = no_return["host_disk"]["ttft_ms_all_p50"] / no_return["tiers_off"]["ttft_ms_all_p50"] - 1
    write_result("returning_chat", {
        "trace": TRACE.name, "conversations": args.conversations, "max_turns": args.max_turns,
        "words_per_block": args.words_per_block, "max_blocks": args.max_blocks,
        "kv_cache_gib": args.kv_cache_gib, "policy": args.policy, "threads": args.threads,
        "output_tokens": OUTPUT_TOKENS, "returning_chats": configs, "nothing_returns": no_return,
        "miss_penalty_ttft_p50_tiers_on": round(penalty, 4), "elapsed_s": round(time.perf_counter() - started_s, 1),
        "note": "one request at a time on a shared CPU machine; compare configurations within one run",
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
