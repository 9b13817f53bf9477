"""Gateway CPU per streamed chat request, its own latency overhead, and the request rate one gateway process sustains.

A real ``sluice serve`` with sim workers (the roofline simulator, fast enough never to be the bottleneck) answers
streamed chat requests of 8 output tokens (``ignore_eos``, ``include_usage``):

- closed loop: ``--concurrency`` clients (32) send ``--requests`` requests back to back; the achieved rate is the
  saturation rate of the gateway process on this machine (client and gateway share its cores);
- open loop: requests start at fixed rates (``--rates``, 100 and 300 requests/s) for ``--open-seconds`` each.

Per phase: gateway CPU ms per request = the gateway process's ``process_cpu_seconds_total`` delta (its ``/metrics``)
÷ requests; overhead = gateway TTFT − worker TTFT per request, from the gateway's own log line of each request
(``ttft_ms``, ``worker_ttft_ms``), p50 and p99; client TTFT p50/p99. Target: ≤ 0.5 ms CPU per request and overhead
p99 ≤ 5 ms at 300 requests/s. Writes ``bench/results/gateway.json``.

    python bench/gateway_bench.py [--requests 1000] [--concurrency 32] [--rates 100,300] [--open-seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import percentile, write_result  # noqa: E402
from tests.support.server import SluiceProcess  # noqa: E402

OUTPUT_TOKENS = 8
TARGET_CPU_MS_PER_REQUEST = 0.5
TARGET_OVERHEAD_P99_MS = 5.0
CONFIG = """
[gateway]
max_tokens_cap = 64

[worker]
num_local_workers = {num_workers}
backend = "sim"
max_num_seqs = 256
capacity_interval_s = 0.25
"""
_CPU_LINE = re.compile(rb"^process_cpu_seconds_total ([0-9.e+-]+)$", re.MULTILINE)


async def gateway_cpu_s(session: aiohttp.ClientSession, base_url: str) -> float:
    """Return the gateway process's CPU seconds so far (user + system), from its Prometheus ``/metrics``."""
    async with session.get(base_url + "/metrics") as response:
        match = _CPU_LINE.search(await response.read())
    if match is None:
        raise RuntimeError("process_cpu_seconds_total missing from /metrics")
    return float(match.group(1))


async def one_request(session: aiohttp.ClientSession, base_url: str, body: dict) -> tuple[str, float | None]:
    """Send one streamed chat request; return (request id, client TTFT in ms, None when no text came)."""
    started_s = time.perf_counter()
    ttft_ms = None
    async with session.post(base_url + "/v1/chat/completions", json=body) as response:
        request_id = response.headers.get("x-request-id", "")
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            is_text = line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line
            if ttft_ms is None and is_text:
                ttft_ms = (time.perf_counter() - started_s) * 1000
    return request_id, ttft_ms


async def closed_loop(session: aiohttp.ClientSession, base_url: str, body: dict, num_requests: int,
                      concurrency: int) -> list[tuple[str, float | None]]:
    """Run ``num_requests`` requests with ``concurrency`` clients back to back."""
    results: list[tuple[str, float | None]] = []
    remaining = iter(range(num_requests))

    async def client() -> None:
        for _ in remaining:
            results.append(await one_request(session, base_url, body))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


async def open_loop(session: aiohttp.ClientSession, base_url: str, body: dict, rate_per_s: float,
                    duration_s: float) -> list[tuple[str, float | None]]:
    """Start requests at ``rate_per_s`` for ``duration_s`` seconds, whatever the earlier ones do."""
    tasks = []
    started_s = time.perf_counter()
    num_requests = int(rate_per_s * duration_s)
    for i in range(num_requests):
        delay_s = started_s + i / rate_per_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one_request(session, base_url, body)))
    return list(await asyncio.gather(*tasks))


def overheads_ms(server: SluiceProcess, request_ids: set[str]) -> list[float]:
    """Return gateway TTFT − worker TTFT in ms of the requests ``request_ids``, from the gateway's log lines."""
    out = []
    for event in server.log_events("request"):
        if (event.get("event") == "request" and event.get("request_id") in request_ids
                and event.get("ttft_ms") is not None and event.get("worker_ttft_ms") is not None):
            out.append(event["ttft_ms"] - event["worker_ttft_ms"])
    return out


async def run_phase(name: str, server: SluiceProcess, session: aiohttp.ClientSession, body: dict, runner) -> dict:
    """Run one phase; return its requests, rate, CPU per request, TTFT and overhead percentiles."""
    cpu_before_s = await gateway_cpu_s(session, server.base_url)
    started_s = time.perf_counter()
    results = await runner()
    wall_s = time.perf_counter() - started_s
    cpu_s = await gateway_cpu_s(session, server.base_url) - cpu_before_s
    await asyncio.sleep(0.5)  # the log lines of the last requests reach the file
    ttfts = [ttft for _, ttft in results if ttft is not None]
    overheads = overheads_ms(server, {request_id for request_id, _ in results})
    phase = {
        "requests": len(results),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(results) / wall_s, 1),
        "gateway_cpu_s": round(cpu_s, 3),
        "cpu_ms_per_request": round(cpu_s * 1000 / len(results), 3),
        "client_ttft_ms_p50": round(percentile(ttfts, 50), 2),
        "client_ttft_ms_p99": round(percentile(ttfts, 99), 2),
        "overhead_ms_p50": round(percentile(overheads, 50), 2),
        "overhead_ms_p99": round(percentile(overheads, 99), 2),
        "overhead_samples": len(overheads),
    }
    print(name, phase, flush=True)
    return phase


async def bench(args: argparse.Namespace, server: SluiceProcess) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.get(server.base_url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
                "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        await closed_loop(session, server.base_url, body, 50, 8)  # warm-up: connections, tokenizer cache
        phases = {f"closed_{args.concurrency}": await run_phase(
            "closed", server, session, body,
            lambda: closed_loop(session, server.base_url, body, args.requests, args.concurrency))}
        for rate in args.rates:
            phases[f"open_{rate:g}_per_s"] = await run_phase(
                f"open {rate:g}/s", server, session, body,
                lambda rate=rate: open_loop(session, server.base_url, body, rate, args.open_seconds))
    return phases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rates", default="100,300", help="open-loop rates, requests/s, comma-separated")
    parser.add_argument("--open-seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2, help="local sim workers")
    parser.add_argument("--out", default="gateway")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",") if r]
    with SluiceProcess(CONFIG.format(num_workers=args.workers), min_ready_workers=args.workers,
                       start_timeout_s=300) as server:
        phases = asyncio.run(bench(args, server))
    closed = phases[f"closed_{args.concurrency}"]
    worst_cpu_ms = max(phase["cpu_ms_per_request"] for phase in phases.values())
    result = {
        "what": "gateway CPU per streamed chat request (8 output tokens, sim workers), overhead = gateway TTFT - "
                "worker TTFT from the gateway's request log",
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        "num_sim_workers": args.workers,
        "phases": phases,
        "saturation_requests_per_s": closed["requests_per_s"],
        "cpu_bound_requests_per_s": round(1000 / worst_cpu_ms, 1) if worst_cpu_ms > 0 else None,
        "target_cpu_ms_per_request": TARGET_CPU_MS_PER_REQUEST,
        "meets_cpu_target": worst_cpu_ms <= TARGET_CPU_MS_PER_REQUEST,
        "target_overhead_p99_ms_at_300_per_s": TARGET_OVERHEAD_P99_MS,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
