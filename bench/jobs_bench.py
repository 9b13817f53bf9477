"""Async jobs only use idle capacity: interactive TTFT with and without a job backlog, and the drain afterwards.

One gateway, one local **sim** worker (the roofline simulator of an H200 serving Llama-3-8B, slowed by
``sim.time_scale`` so the 2 shared CPU cores keep up), ``max_num_seqs`` 8. Closed-loop interactive load:
12 streaming clients (1.5 × the worker's sequence slots, so the worker stays full and requests wait in admission),
MT-Bench first-turn prompts, 16–48 output tokens (mean 32, ``ignore_eos``). Phases, in one run:

1. **baseline**: the interactive load alone for ``--load-s`` seconds → TTFT.
2. **with jobs**: ``--jobs`` jobs queued first (``POST /v1/jobs``, 32 tokens each), then the same load → TTFT, and
   how many jobs finished during the load (the claim is: none start while the interactive load keeps the worker full).
3. **drain**: the load stops → time until every job succeeded, and the drain rate in output tokens/s compared with
   the interactive rate at saturation (the claim: jobs drain at the full speed of the worker).

Result: TTFT p50 / p95 / p99 per phase and their ratios (with jobs ÷ baseline), jobs finished during the load,
drain time and rate. JSON to bench/results/jobs.json.

Run: ``.venv/bin/python -m bench.jobs_bench`` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import mt_bench_prompts, percentile, sluice_server, write_result

MODEL = "SmolLM2-135M-Instruct"
OUTPUT_TOKENS = 32
MAX_NUM_SEQS = 8
CONFIG = """
[model]
max_model_len_tokens = 4096

[gateway]
max_tokens_cap = 512

[worker]
num_local_workers = 1
backend = "sim"
max_num_seqs = {max_num_seqs}
capacity_interval_s = 0.05

[sim]
time_scale = {time_scale}

[jobs]
store = "sqlite"
sqlite_path = "{sqlite_path}"
poll_interval_s = 0.05
"""


def _output_tokens(index: int) -> int:
    """Output length of request ``index``: 16–48 tokens (mean 32), fixed per index, so both phases see the same
    mix and equal-length requests do not march through the worker in lockstep waves."""
    return OUTPUT_TOKENS // 2 + (index * 7919) % (OUTPUT_TOKENS + 1)


def _body(prompt: str, stream: bool, max_tokens: int = OUTPUT_TOKENS) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _one_stream(session: aiohttp.ClientSession, base_url: str, prompt: str,
                      max_tokens: int = OUTPUT_TOKENS) -> tuple[float | None, int]:
    start = time.perf_counter()
    ttft_s = None
    tokens = 0
    async with session.post(base_url + "/v1/chat/completions", json=_body(prompt, True, max_tokens)) as response:
        if response.status != 200:
            await response.read()
            return None, 0
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft_s is None and chunk.get("choices"):
                ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft_s, tokens


async def _interactive_load(base_url: str, prompts: list[str], clients: int, duration_s: float) -> dict:
    """Run ``clients`` closed-loop streaming clients for ``duration_s``; return TTFTs, tokens and errors."""
    ttfts_ms: list[float] = []
    num_errors = 0
    total_tokens = 0
    deadline = time.perf_counter() + duration_s

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal num_errors, total_tokens
        i = index
        while time.perf_counter() < deadline:
            ttft_s, tokens = await _one_stream(session, base_url, prompts[i % len(prompts)], _output_tokens(i))
            i += clients
            if ttft_s is None:
                num_errors += 1
                await asyncio.sleep(0.1)
                continue
            ttfts_ms.append(ttft_s * 1000)
            total_tokens += tokens

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    wall_s = time.perf_counter() - start
    return {"ttfts_ms": ttfts_ms, "num_requests": len(ttfts_ms), "num_errors": num_errors,
            "completion_tokens": total_tokens, "wall_s": wall_s}


async def _job_statuses(session: aiohttp.ClientSession, base_url: str, job_ids: list[str]) -> dict[str, dict]:
    jobs: dict[str, dict] = {}
    after = None
    while True:
        url = base_url + "/v1/jobs?limit=100" + (f"&after={after}" if after else "")
        async with session.get(url) as response:
            page = await response.json()
        for job in page["data"]:
            jobs[job["id"]] = job
        if not page["has_more"]:
            break
        after = page["last_id"]
    return {job_id: jobs[job_id] for job_id in job_ids if job_id in jobs}


def _count(jobs: dict[str, dict], status: str) -> int:
    return sum(job["status"] == status for job in jobs.values())


def _ttft_summary(run: dict) -> dict:
    values = run["ttfts_ms"]
    return {
        "requests": run["num_requests"],
        "errors": run["num_errors"],
        "ttft_ms_mean": round(sum(values) / len(values), 1) if values else float("nan"),
        "ttft_ms_p50": round(percentile(values, 50), 1),
        "ttft_ms_p95": round(percentile(values, 95), 1),
        "ttft_ms_p99": round(percentile(values, 99), 1),
        "completion_tokens_per_s": round(run["completion_tokens"] / run["wall_s"], 1),
    }


async def _bench(base_url: str, num_jobs: int, clients: int, load_s: float) -> dict:
    prompts = mt_bench_prompts(80)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _one_stream(session, base_url, prompts[0])  # warm-up
    baseline = await _interactive_load(base_url, prompts, clients, load_s)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        load_started_s = time.perf_counter()
        load_task = asyncio.create_task(_interactive_load(base_url, prompts, clients, load_s))
        await asyncio.sleep(1.0)  # the load fills the worker first, then the backlog arrives
        job_ids = []
        for i in range(num_jobs):
            async with session.post(base_url + "/v1/jobs", json=_body(prompts[i % len(prompts)], False)) as response:
                job_ids.append((await response.json())["id"])
        at_submit = await _job_statuses(session, base_url, job_ids)
        await asyncio.sleep(max(0.0, load_s - 1.0 - (time.perf_counter() - load_started_s)))
        late_in_load = await _job_statuses(session, base_url, job_ids)  # the load is still full here
        with_jobs = await load_task
        load_end_s = time.perf_counter()
        at_load_end = await _job_statuses(session, base_url, job_ids)
        statuses = at_load_end
        while _count(statuses, "succeeded") + _count(statuses, "failed") < num_jobs:
            await asyncio.sleep(0.1)
            statuses = await _job_statuses(session, base_url, job_ids)
        drain_s = time.perf_counter() - load_end_s
        first_start = min(job["started_at"] for job in statuses.values())
        last_finish = max(job["finished_at"] for job in statuses.values())
    job_tokens = sum(job["result"]["usage"]["completion_tokens"] for job in statuses.values() if job["result"])
    started_during_load = sum(1 for job in late_in_load.values() if job["status"] != "queued")
    base, loaded = _ttft_summary(baseline), _ttft_summary(with_jobs)
    drain_rate = job_tokens / drain_s if drain_s > 0 else float("nan")
    return {
        "baseline": base,
        "with_jobs_queued": loaded,
        "ttft_ratio_mean": round(loaded["ttft_ms_mean"] / base["ttft_ms_mean"], 3),
        "ttft_ratio_p50": round(loaded["ttft_ms_p50"] / base["ttft_ms_p50"], 3),
        "ttft_ratio_p95": round(loaded["ttft_ms_p95"] / base["ttft_ms_p95"], 3),
        "ttft_ratio_p99": round(loaded["ttft_ms_p99"] / base["ttft_ms_p99"], 3),
        "jobs": {
            "submitted": num_jobs,
            "queued_at_submit_end": _count(at_submit, "queued"),
            "started_during_load": started_during_load,  # sampled 1 s before the load ends
            "succeeded_during_load": _count(late_in_load, "succeeded"),
            "started_by_load_end": sum(1 for job in at_load_end.values() if job["status"] != "queued"),
            "succeeded": _count(statuses, "succeeded"),
            "failed": _count(statuses, "failed"),
            "failed_errors": sorted({json.dumps(job["error"]) for job in statuses.values()
                                     if job["status"] == "failed"}),
            "drain_s": round(drain_s, 2),
            "first_start_to_last_finish_s": round(last_finish - first_start, 2),
            "drain_completion_tokens_per_s": round(drain_rate, 1),
            "drain_rate_vs_interactive_saturated": round(drain_rate / base["completion_tokens_per_s"], 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=120)
    parser.add_argument("--clients", type=int, default=MAX_NUM_SEQS * 3 // 2)
    parser.add_argument("--load-s", type=float, default=25.0)
    parser.add_argument("--time-scale", type=float, default=2.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        config = CONFIG.format(max_num_seqs=MAX_NUM_SEQS, time_scale=args.time_scale,
                               sqlite_path=Path(tmp) / "jobs.sqlite3")
        with sluice_server(config) as base_url:
            result = asyncio.run(_bench(base_url, args.jobs, args.clients, args.load_s))
    result["setup"] = {"backend": "sim (roofline simulator: H200, Llama-3-8B bf16)", "sim_time_scale": args.time_scale,
                       "max_num_seqs": MAX_NUM_SEQS, "interactive_clients": args.clients, "load_s": args.load_s,
                       "output_tokens": "16-48 (mean 32)", "jobs": args.jobs}
    write_result("jobs", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
