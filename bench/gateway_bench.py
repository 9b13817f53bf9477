"""The gateway's own cost: CPU per streamed chat request, its TTFT overhead at fixed rates, and one process's ceiling.

One ``sluice serve`` with ``--workers`` local **sim** workers (the roofline simulator, its steps shortened by
``--time-scale`` and ``max_num_seqs`` 128, so the workers are never the bottleneck) and admission on. Every request is
the same shape: a streamed chat completion (``stream_options.include_usage``) with a fixed system prompt and an
MT-Bench first-turn user prompt (80 distinct, cycled; ``--unique-prompts`` makes each one unique, so only the
system prompt repeats), ``max_tokens`` 8 with ``ignore_eos`` — 8 output tokens, a role chunk, 8 content chunks, a
finish chunk, the usage chunk and ``[DONE]``.

The load client runs in ``--client-processes`` processes of its own (raw ``aiohttp``), so its CPU is not the
gateway's and one client process is not the bottleneck.
Phases, in one run, each bounded by a request count and a wall-clock limit:

1. **closed loop**: ``--concurrency`` (32) clients back to back for ``--closed-requests`` (2000) requests. Its
   throughput is the **saturation rate** of the one gateway process when the gateway's CPU use is near one core
   (reported as ``gateway_cpu_utilisation``); ``cpu_bound_rps`` = 1000 ÷ CPU ms per request is the ceiling
   the CPU cost alone allows.
2. **open loop** at each of ``--rates`` (100 and 300 requests/s) for ``--open-s`` seconds: evenly spaced arrivals,
   whatever the answers do.
3. **paired rounds**: ``--rounds`` (5) more closed loops, each on the gateway and then on
   :mod:`bench.bare_sse_server` (aiohttp + uvloop streaming the same answer shape, nothing else; it runs beside the
   gateway from the start), so each round's pair sees the same machine.

Per phase:

- ``gateway_cpu_ms_per_request``: the gateway process's CPU time (user + system, ``/proc/<pid>/stat``, the source of
  ``process_cpu_seconds_total``; its worker processes are not counted) over the phase ÷ requests completed.
- ``overhead_ms`` p50 / p99: the gateway's TTFT minus the worker's TTFT (``Delta.first_token_latency_ms``: Generate
  received → first token), per request, from the gateway's request log line (``ttft_ms``, ``worker_ttft_ms``).
- ``client_overhead_ms`` p50 / p99: the client's TTFT (request sent → first content chunk read) minus the same
  worker TTFT — also counts HTTP parsing before the handler, SSE writing and loopback both ways.
- ``admission_queue_ms`` p50 / p99: the part of the overhead spent queued in admission (``queue_ms``), by design
  when the workers' prefill backlog is full.
- ``client_ttft_ms`` p50 / p99, ``achieved_rps``, errors.

The headline figures come from the paired rounds (``closed_loop_rounds``): ``gateway_cpu_ms_per_request`` and
``bare_aiohttp_cpu_ms_per_request`` are the medians of each side's rounds, the second this machine's floor;
``gateway_over_bare_cpu_ratio`` is the median of the rounds' ratios, a figure that travels between machines better
than milliseconds do.

Result: JSON to ``bench/results/gateway.json``. Loopback only.

Run: ``.venv/bin/python -m bench.gateway_bench`` (about 1.5 minutes; ``--quick`` for a 20-second smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common import mt_bench_prompts, percentile, write_result
from tests.support.server import SluiceProcess, free_port

MODEL = "SmolLM2-135M-Instruct"
OUTPUT_TOKENS = 8
IDLE_S = 2.0  # seconds of no load, to measure the gateway's background CPU (capacity reports, timers)
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and precisely."
CONFIG = """
[model]
name = "{model}"

[gateway]
max_tokens_cap = 64
default_max_tokens = 16
tokenizer_threads = 1

[worker]
num_local_workers = {workers}
backend = "sim"
max_num_seqs = 128
max_num_batched_tokens = 8192
capacity_interval_s = 0.25

[sim]
time_scale = {time_scale}

[autoscale]
enabled = false
"""


def _body(prompt: str) -> bytes:
    return json.dumps({
        "model": MODEL, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}],
    }).encode()


# ---------------------------------------------------------------------- the load client (its own process)


async def _one_stream(session, url: str, body: bytes) -> tuple[str, float | None, bool]:
    """Send one streamed request; return (request id, client TTFT in ms or None, ok)."""
    start_s = time.perf_counter()
    ttft_ms = None
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        request_id = response.headers.get("x-request-id", "")
        if response.status != 200:
            await response.read()
            return request_id, None, False
        done = False
        async for line in response.content:
            if ttft_ms is None and line.startswith(b'data: {"id"') and b'"content":"' in line \
                    and b'"content":""' not in line:
                ttft_ms = (time.perf_counter() - start_s) * 1000.0
            if line.startswith(b"data: [DONE]"):
                done = True
    return request_id, ttft_ms, done


async def _run_phase(base_url: str, prompts: list[str], concurrency: int, num_requests: int,
                     rate_rps: float | None, limit_s: float, unique_prompts: bool = False) -> dict:
    """Closed loop (``rate_rps`` None: ``concurrency`` clients) or open loop at ``rate_rps``; bounded by
    ``num_requests`` and ``limit_s``."""
    import aiohttp

    url = base_url + "/v1/chat/completions"
    bodies = [_body(p) for p in prompts]
    nonce = os.urandom(4).hex()
    results: list[tuple[str, float | None, bool]] = []
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=0 if rate_rps else concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(index: int) -> None:
            try:
                body = (_body(f"{prompts[index % len(prompts)]} (request {nonce}-{index})") if unique_prompts
                        else bodies[index % len(bodies)])
                results.append(await _one_stream(session, url, body))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(type(exc).__name__)

        start_s = time.perf_counter()
        deadline_s = start_s + limit_s
        if rate_rps is None:
            counter = iter(range(num_requests))

            async def client() -> None:
                for index in counter:
                    if time.perf_counter() > deadline_s:
                        return
                    await one(index)

            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:
            tasks = []
            for index in range(num_requests):
                due_s = start_s + index / rate_rps
                if due_s > deadline_s:
                    break
                delay_s = due_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                tasks.append(asyncio.create_task(one(index)))
            await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - start_s
    return {"results": results, "errors": errors, "wall_s": wall_s}


def _client_process(conn, base_url: str, prompts: list[str], phase: dict) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    conn.send(asyncio.run(_run_phase(base_url, prompts, **phase)))
    conn.close()


def run_client(base_url: str, prompts: list[str], num_processes: int, concurrency: int, num_requests: int,
               rate_rps: float | None, limit_s: float, unique_prompts: bool = False) -> dict:
    """Run one load phase in ``num_processes`` client processes (so the client's CPU is not the gateway's, and
    one client process is not the bottleneck), each with its share of the concurrency, requests and rate."""
    ctx = multiprocessing.get_context("spawn")
    processes, pipes = [], []
    for i in range(num_processes):
        share = dict(concurrency=max(1, concurrency // num_processes),
                     num_requests=num_requests // num_processes + (i < num_requests % num_processes),
                     rate_rps=None if rate_rps is None else rate_rps / num_processes, limit_s=limit_s,
                     unique_prompts=unique_prompts)
        parent, child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_client_process, args=(child, base_url, prompts[i:] + prompts[:i], share),
                              daemon=True)
        process.start()
        processes.append(process)
        pipes.append(parent)
    merged: dict = {"results": [], "errors": [], "wall_s": 0.0}
    try:
        for parent in pipes:
            part = parent.recv()
            merged["results"] += part["results"]
            merged["errors"] += part["errors"]
            merged["wall_s"] = max(merged["wall_s"], part["wall_s"])
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return merged


# ---------------------------------------------------------------------- measurement


def process_cpu_s(pid: int) -> float:
    """Return the CPU seconds (user + system) process ``pid`` has used, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_log(log_path: Path) -> dict[str, dict]:
    """Return the gateway's ``request`` log lines (structlog JSON) by request id."""
    lines: dict[str, dict] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if '"event": "request"' not in line and '"event":"request"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("request_id"):
            lines[record["request_id"]] = record
    return lines


def _stats(values: list[float]) -> dict:
    return {"p50": round(percentile(values, 50), 3), "p99": round(percentile(values, 99), 3), "n": len(values)}


def summarize(name: str, phase: dict, cpu_s: float, log_lines: dict[str, dict]) -> dict:
    """Turn a phase's client results, the gateway's CPU delta and its log lines into the phase's numbers."""
    ok = [r for r in phase["results"] if r[2]]
    overhead_ms, client_overhead_ms, client_ttft_ms, queue_ms = [], [], [], []
    for request_id, ttft_ms, _ in ok:
        record = log_lines.get(request_id, {})
        if record.get("queue_ms") is not None:
            queue_ms.append(record["queue_ms"])
        worker_ttft_ms = record.get("worker_ttft_ms")
        if ttft_ms is not None:
            client_ttft_ms.append(ttft_ms)
        if worker_ttft_ms is None:
            continue
        if record.get("ttft_ms") is not None:
            overhead_ms.append(record["ttft_ms"] - worker_ttft_ms)
        if ttft_ms is not None:
            client_overhead_ms.append(ttft_ms - worker_ttft_ms)
    num_done = len(phase["results"])
    return {
        "phase": name,
        "requests_ok": len(ok),
        "requests_failed": num_done - len(ok) + len(phase["errors"]),
        "wall_s": round(phase["wall_s"], 3),
        "achieved_rps": round(len(ok) / phase["wall_s"], 1),
        "gateway_cpu_s": round(cpu_s, 3),
        "gateway_cpu_ms_per_request": round(cpu_s * 1000 / max(1, num_done), 3),
        "gateway_cpu_utilisation": round(cpu_s / phase["wall_s"], 3),
        "overhead_ms": _stats(overhead_ms),
        "client_overhead_ms": _stats(client_overhead_ms),
        "client_ttft_ms": _stats(client_ttft_ms),
        "admission_queue_ms": _stats(queue_ms),
    }


def _start_py_spy(pid: int, svg_path: str) -> subprocess.Popen:
    """Sample ``pid`` with py-spy (``pip install py-spy``) until SIGINT, only the thread holding the GIL (Python CPU,
    not threads waiting for it): a flame graph, or collapsed stacks when
    ``svg_path`` ends in ``.txt``."""
    py_spy = str(Path(sys.executable).parent / "py-spy")
    output_format = "raw" if svg_path.endswith(".txt") else "flamegraph"
    spy = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--output", svg_path, "--format", output_format,
                            "--rate", "250", "--nonblocking", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return spy


@contextlib.contextmanager
def bare_server(prompts: list[str], args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """Run :mod:`bench.bare_sse_server`, warmed up with ``args.warmup_requests`` requests; yield its base URL and
    pid. It stays up beside the gateway, so the two are measured in alternation (:func:`paired_rounds`)."""
    import urllib.request

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.bare_sse_server", str(port)])
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            except urllib.error.HTTPError:
                break  # it answers (404 for GET /)
            except OSError:
                time.sleep(0.05)
        base_url = f"http://127.0.0.1:{port}"
        run_client(base_url, prompts, args.client_processes, concurrency=args.concurrency,
                   num_requests=args.warmup_requests, rate_rps=None, limit_s=60.0)
        yield base_url, server.pid
    finally:
        server.terminate()
        server.wait(timeout=10)


def closed_loop_cpu_ms(base_url: str, pid: int, prompts: list[str], args: argparse.Namespace) -> float:
    """Run one closed loop of ``args.closed_requests`` at ``args.concurrency`` against ``base_url`` and return the
    CPU ms per request of process ``pid``."""
    time.sleep(0.3)
    cpu_before_s = process_cpu_s(pid)
    phase = run_client(base_url, prompts, args.client_processes, concurrency=args.concurrency,
                       num_requests=args.closed_requests, rate_rps=None, limit_s=120.0)
    cpu_s = process_cpu_s(pid) - cpu_before_s
    return round(cpu_s * 1000 / max(1, len(phase["results"])), 3)


def paired_rounds(gateway: tuple[str, int], bare: tuple[str, int], prompts: list[str],
                  args: argparse.Namespace) -> list[dict]:
    """Measure the closed loop's CPU ms per request ``args.rounds`` times on the gateway and then on the bare server,
    in alternation, so both see the same machine (another process's load, frequency, cache) each round; return one
    ``{"gateway_cpu_ms", "bare_cpu_ms", "ratio"}`` per round. One round alone moved the ratio by 1.6-2.8 on a quiet
    2-core machine (three runs of the single-round bench, minutes apart); the medians of the rounds are the result."""
    rounds = []
    for _ in range(args.rounds):
        gateway_ms = closed_loop_cpu_ms(*gateway, prompts, args)
        bare_ms = closed_loop_cpu_ms(*bare, prompts, args)
        rounds.append({"gateway_cpu_ms": gateway_ms, "bare_cpu_ms": bare_ms,
                       "ratio": round(gateway_ms / bare_ms, 3) if bare_ms > 0 else None})
        print(json.dumps(rounds[-1]), flush=True)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="local sim workers")
    parser.add_argument("--time-scale", type=float, default=0.2, help="sim.time_scale (shorter simulated steps)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=2, help="load client processes")
    parser.add_argument("--closed-requests", type=int, default=2000, help="requests of each closed loop")
    parser.add_argument("--rounds", type=int, default=5,
                        help="closed loops measured in alternation on the gateway and the bare server")
    parser.add_argument("--rates", type=float, nargs="*", default=[100.0, 300.0])
    parser.add_argument("--open-s", type=float, default=10.0, help="seconds of each open-loop rate")
    parser.add_argument("--warmup-requests", type=int, default=200)
    parser.add_argument("--unique-prompts", action="store_true",
                        help="make every user prompt unique (no conversation-cache hits; the system prompt repeats)")
    parser.add_argument("--quick", action="store_true", help="short smoke run (300 closed, 3 s per rate)")
    parser.add_argument("--out", default="gateway", help="result name under bench/results/, or a path ending in .json")
    parser.add_argument("--profile", default="", help="py-spy flame graph (SVG; collapsed stacks for .txt) of the "
                        "gateway during one phase")
    parser.add_argument("--profile-phase", default="closed_loop", help="the phase --profile samples")
    args = parser.parse_args()
    if args.quick:
        args.closed_requests, args.open_s, args.warmup_requests, args.rounds = 300, 3.0, 50, 1

    prompts = mt_bench_prompts(80)
    config = CONFIG.format(model=MODEL, workers=args.workers, time_scale=args.time_scale)
    phases = []
    with SluiceProcess(config, min_ready_workers=args.workers) as server, bare_server(prompts, args) as bare:
        pid = server.process.pid
        run_client(server.base_url, prompts, args.client_processes, concurrency=args.concurrency,
                   num_requests=args.warmup_requests, rate_rps=None, limit_s=60.0)
        plan = [("closed_loop", dict(concurrency=args.concurrency, num_requests=args.closed_requests,
                                     rate_rps=None, limit_s=120.0, unique_prompts=args.unique_prompts))]
        plan += [(f"open_loop_{rate:g}_rps", dict(concurrency=args.concurrency, num_requests=int(rate * args.open_s),
                                                  rate_rps=rate, limit_s=args.open_s + 30.0,
                                                  unique_prompts=args.unique_prompts))
                 for rate in args.rates]
        idle_cpu_before_s = process_cpu_s(pid)
        time.sleep(IDLE_S)
        idle_cpu_ms_per_s = (process_cpu_s(pid) - idle_cpu_before_s) * 1000 / IDLE_S
        for name, phase_args in plan:
            time.sleep(0.5)
            spy = _start_py_spy(pid, args.profile) if args.profile and name == args.profile_phase else None
            cpu_before_s = process_cpu_s(pid)
            phase = run_client(server.base_url, prompts, args.client_processes, **phase_args)
            cpu_s = process_cpu_s(pid) - cpu_before_s
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            time.sleep(0.3)  # the last log lines are flushed
            phases.append(summarize(name, phase, cpu_s, request_log(server.log_path)))
            print(json.dumps(phases[-1]), flush=True)
        rounds = paired_rounds((server.base_url, pid), bare, prompts, args)
    closed = phases[0]
    cpu_ms = statistics.median(r["gateway_cpu_ms"] for r in rounds)
    bare_cpu_ms = statistics.median(r["bare_cpu_ms"] for r in rounds)
    ratio = statistics.median(r["ratio"] for r in rounds if r["ratio"] is not None)
    result = {
        "bench": "gateway",
        "config": {"workers": args.workers, "client_processes": args.client_processes, "time_scale": args.time_scale,
                   "concurrency": args.concurrency, "unique_prompts": args.unique_prompts,
                   "closed_requests": args.closed_requests, "rounds": args.rounds, "rates_rps": args.rates,
                   "open_s": args.open_s,
                   "output_tokens": OUTPUT_TOKENS, "cpu_count": os.cpu_count(),
                   "load_avg_1m": round(os.getloadavg()[0], 2)},
        "gateway_cpu_ms_per_request": cpu_ms,
        "saturation_rps": closed["achieved_rps"],
        "cpu_bound_rps": round(1000.0 / cpu_ms, 1) if cpu_ms > 0 else None,
        "bare_aiohttp_cpu_ms_per_request": bare_cpu_ms,
        "gateway_over_bare_cpu_ratio": round(ratio, 2),
        "closed_loop_rounds": rounds,
        "idle_gateway_cpu_ms_per_s": round(idle_cpu_ms_per_s, 2),
        "phases": phases,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
