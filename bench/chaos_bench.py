"""Chaos bench: steady mixed load against a gateway with two local workers while faults are injected.

Loopback only, bounded in time (``--phase-s`` per phase, two phases: jobs in SQLite, then jobs in Redis). The load
is streamed and non-streamed chat requests, async jobs (``/v1/jobs``) and one Batch per phase. Injected, several
times each: ``kill -9`` of a worker while streams run, ``SIGSTOP`` of a worker past ``gateway.stall_timeout_s`` then
``SIGCONT``, a client flood at 10× the sequence slots, ``kill -9`` of the gateway (restarted on the same config:
SQLite file, then Redis), and Redis stopped and started (its own ``redis-server`` on a free port, append-only file
in the work folder, never the shared one). The workers are the sim backend (the roofline SIMULATOR) by default, so
that restarts take a second and a flood loads the gateway beyond what the CPU model serves; ``--backend cpu`` runs
the real model.

Every request ends in one of: answered (200, a stream ends with ``[DONE]`` and no error event), failed cleanly (an
OpenAI error envelope, or an in-band error event then ``[DONE]``), connection refused or cut while the gateway was
killed (counted apart), or hung (no end within its deadline + 5 s). Jobs: lost (unknown after the restarts), run
twice (more than one successful finish logged), stuck (not final at the end). KV blocks and RSS (gateway, workers)
are read after warm-up and after the load. Targets: zero hung, lost, run twice, stuck; KV back to zero; RSS within
10%. JSON in bench/results/chaos.json.

    .venv/bin/python -m bench.chaos_bench [--phase-s 150] [--backend sim|cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import write_result
from tests.support.server import SluiceProcess, free_port, get_json

MODEL = "SmolLM2-135M-Instruct"
DEADLINE_S = 60.0  # a request's own deadline; hung = no end within it + 5 s
STALL_TIMEOUT_S = 3.0
MAX_NUM_SEQS = 8
NUM_WORKERS = 2
PROMPTS = ["Tell me a story about a lighthouse.", "List ten fruits.", "Explain what a queue is.",
           "Write a haiku about rain.", "Count from 1 to 50."]


def config_text(backend: str, jobs: str) -> str:
    return f"""
[model]
max_model_len_tokens = 2048
weights = "float32"

[gateway]
max_tokens_cap = 256
default_max_tokens = 32
first_token_timeout_s = 20.0
stall_timeout_s = {STALL_TIMEOUT_S}

[worker]
num_local_workers = {NUM_WORKERS}
backend = "{backend}"
max_num_seqs = {MAX_NUM_SEQS}
kv_cache_gib = 0.1
num_threads = 1
capacity_interval_s = 0.1

[sim]
time_scale = 10.0

[jobs]
{jobs}
"""


class RedisServer:
    """Our own ``redis-server`` on a free loopback port, append-only (fsync always) in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout.strip() != b"PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)


def rss_bytes(pid: int | None) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, TypeError):
        pass
    return 0


class Load:
    """The steady load and its outcome counts."""

    def __init__(self, server: SluiceProcess) -> None:
        self.server = server
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.job_ids: list[str] = []
        self.gateway_down = False
        self.stop = asyncio.Event()

    async def request(self, session: aiohttp.ClientSession, stream: bool, max_tokens: int = 48,
                      kind: str = "") -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "max_tokens": max_tokens, "stream": stream}
        label = kind or ("stream" if stream else "non_stream")
        down_at_start = self.gateway_down
        try:
            async with asyncio.timeout(DEADLINE_S + 5):
                async with session.post(self.server.base_url + "/v1/chat/completions", json=body) as response:
                    raw = await response.read()
            outcome = self._classify(response.status, raw, stream)
        except TimeoutError:
            outcome = "hung"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            outcome = "cut_by_gateway_kill" if (self.gateway_down or down_at_start) else "connection_error"
        self.outcomes[f"{label}:{outcome}"] += 1

    def _classify(self, status: int, raw: bytes, stream: bool) -> str:
        if status != 200:
            try:
                code = json.loads(raw)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                return "failed_unclean"
            self.errors[f"{status}:{code}"] += 1
            return "failed_internal" if status == 500 else "failed_cleanly"
        if not stream:
            return "answered"
        text = raw.decode(errors="replace")
        if not text.rstrip().endswith("data: [DONE]"):
            return "failed_unclean"
        if '"error":' in text:
            code = text.split('"code":"', 1)[-1].split('"', 1)[0]
            self.errors[f"in_band:{code}"] += 1
            return "failed_cleanly"
        return "answered"

    async def submit_job(self, session: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": 16}
        try:
            async with session.post(self.server.base_url + "/v1/jobs", json=body,
                                    timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as response:
                payload = await response.json(content_type=None)
            if response.status in (200, 201, 202):
                self.job_ids.append(payload["id"])
                self.outcomes["job_submit:accepted"] += 1
            else:
                self.outcomes["job_submit:failed_cleanly"] += 1
                self.errors[f"job_submit:{response.status}:{(payload.get('error') or {}).get('code')}"] += 1
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.outcomes["job_submit:refused_or_cut"] += 1

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            tasks: set[asyncio.Task] = set()
            tick = 0
            while not self.stop.is_set():
                tick += 1
                tasks.add(asyncio.create_task(self.request(session, stream=True)))
                if tick % 2 == 0:
                    tasks.add(asyncio.create_task(self.request(session, stream=False)))
                if tick % 3 == 0:
                    tasks.add(asyncio.create_task(self.submit_job(session)))
                tasks = {t for t in tasks if not t.done()}
                await asyncio.sleep(0.25)
            await asyncio.gather(*tasks)

    async def flood(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*[self.request(session, stream=i % 2 == 0, max_tokens=16, kind="flood")
                                   for i in range(10 * NUM_WORKERS * MAX_NUM_SEQS)])


def local_workers(server: SluiceProcess) -> list[dict]:
    """Return ``/status`` ``local_workers`` ([] while the gateway does not answer)."""
    try:
        code, status = get_json(server.base_url + "/status")
    except OSError:
        return []
    return status.get("local_workers", []) if code == 200 else []


def kv_and_rss(server: SluiceProcess) -> dict:
    code, status = get_json(server.base_url + "/status")
    workers = status.get("workers", []) if code == 200 else []
    return {"used_kv_blocks": sum((w.get("capacity") or {}).get("used_kv_blocks", 0) for w in workers),
            "running": sum((w.get("capacity") or {}).get("num_running", 0) for w in workers),
            "gateway_rss_mb": round(rss_bytes(server.process.pid) / 2**20, 1),
            "workers_rss_mb": round(sum(rss_bytes(w.get("pid")) for w in local_workers(server)) / 2**20, 1)}


async def wait_idle(server: SluiceProcess, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    state = kv_and_rss(server)
    while (state["used_kv_blocks"] or state["running"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        state = kv_and_rss(server)
    return state


async def wait_ready(server: SluiceProcess, timeout_s: float = 120) -> None:
    await asyncio.to_thread(server.wait_ready, timeout_s)


async def inject(server: SluiceProcess, load: Load, redis: RedisServer | None, phase_s: float,
                 injected: collections.Counter[str]) -> None:
    """Run the phase's faults one after another, spread over ``phase_s``."""
    faults = ["kill_worker", "stop_worker", "flood", "kill_worker", "stop_worker", "kill_gateway", "flood"]
    if redis is not None:
        faults[3:3] = ["redis_restart"]
        faults.append("redis_restart")
    gap_s = phase_s / (len(faults) + 1)
    for fault in faults:
        await asyncio.sleep(gap_s)
        workers = [w for w in local_workers(server) if w.get("pid")]
        if fault == "kill_worker" and workers:
            os.kill(random.choice(workers)["pid"], signal.SIGKILL)
        elif fault == "stop_worker" and workers:
            pid = random.choice(workers)["pid"]
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(STALL_TIMEOUT_S + 2)
            os.kill(pid, signal.SIGCONT)
        elif fault == "flood":
            await load.flood()
        elif fault == "redis_restart":
            redis.stop()
            await asyncio.sleep(3)
            redis.start()
        elif fault == "kill_gateway":
            load.gateway_down = True
            await asyncio.to_thread(server.kill9)
            await asyncio.sleep(1)
            await asyncio.to_thread(server.start, False)
            await wait_ready(server)
            load.gateway_down = False
        injected[fault] += 1


async def job_results(server: SluiceProcess, job_ids: list[str], timeout_s: float) -> dict:
    """Wait for every job to be final; count lost (404) and stuck (not final in time) jobs."""
    final = {"succeeded", "failed", "cancelled", "expired"}
    deadline = time.monotonic() + timeout_s
    statuses: dict[str, str] = {}
    async with aiohttp.ClientSession() as session:
        while True:
            for job_id in job_ids:
                if statuses.get(job_id) in final:
                    continue
                async with session.get(f"{server.base_url}/v1/jobs/{job_id}") as response:
                    statuses[job_id] = (await response.json())["status"] if response.status == 200 else "lost"
            pending = [j for j in job_ids if statuses[j] not in final and statuses[j] != "lost"]
            if not pending or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
    counts = collections.Counter(statuses.values())
    finishes = collections.Counter(event.get("job_id") for event in server.log_events("job_finished")
                                   if event.get("status") == "succeeded")
    return {"submitted": len(job_ids), "by_status": dict(counts), "lost": counts.get("lost", 0),
            "stuck": sum(1 for s in statuses.values() if s not in final and s != "lost"),
            "run_twice": sum(1 for job_id in job_ids if finishes[job_id] > 1)}


async def batch_result(server: SluiceProcess, batch_id: str, num_lines: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{server.base_url}/v1/batches/{batch_id}") as response:
                batch = await response.json()
            if batch.get("status") in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        ids: list[str] = []
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                async with session.get(f"{server.base_url}/v1/files/{batch[key]}/content") as response:
                    ids += [json.loads(line)["custom_id"] for line in (await response.text()).splitlines() if line]
    return {"status": batch.get("status"), "lines": num_lines, "answered_lines": len(set(ids)),
            "duplicated_lines": len(ids) - len(set(ids)), "missing_lines": num_lines - len(set(ids))}


async def create_batch(server: SluiceProcess, num_lines: int) -> str:
    lines = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}})
        for i in range(num_lines))
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", lines.encode(), filename="chaos.jsonl")
        async with session.post(server.base_url + "/v1/files", data=form) as response:
            file_id = (await response.json())["id"]
        async with session.post(server.base_url + "/v1/batches", json={
                "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}) as response:
            return (await response.json())["id"]


async def run_phase(name: str, backend: str, jobs: str, workdir: Path, redis: RedisServer | None,
                    phase_s: float) -> dict:
    server = SluiceProcess(config_text(backend, jobs), workdir / name, min_ready_workers=NUM_WORKERS)
    server.start()
    try:
        load = Load(server)
        warm = asyncio.create_task(load.run())
        await asyncio.sleep(5)
        load.stop.set()
        await warm
        before = await wait_idle(server, 30)
        load = Load(server)
        batch_id = await create_batch(server, 40)
        injected: collections.Counter[str] = collections.Counter()
        runner = asyncio.create_task(load.run())
        await inject(server, load, redis, phase_s, injected)
        load.stop.set()
        await runner
        jobs_out = await job_results(server, load.job_ids, 90)
        batch_out = await batch_result(server, batch_id, 40, 90)
        after = await wait_idle(server, 30)
        return {"injected": dict(injected), "requests": dict(sorted(load.outcomes.items())),
                "errors": dict(sorted(load.errors.items())), "jobs": jobs_out, "batch": batch_out,
                "before": before, "after": after,
                "gateway_rss_ratio": round(after["gateway_rss_mb"] / max(before["gateway_rss_mb"], 1e-9), 3)}
    finally:
        server.stop(kill_group=True)


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="sluice-chaos-") as tmp:
        workdir = Path(tmp)
        redis = RedisServer(workdir)
        redis.start()
        try:
            sqlite = await run_phase("sqlite", args.backend, f'store = "sqlite"\nsqlite_path = "{workdir}/jobs.sqlite3"'
                                     "\nlease_timeout_s = 3.0\npoll_interval_s = 0.1\n", workdir, None, args.phase_s)
            redis_phase = await run_phase("redis", args.backend, f'store = "redis"\nredis_url = '
                                          f'"redis://127.0.0.1:{redis.port}/0"\nredis_key_prefix = "chaos"\n'
                                          "lease_timeout_s = 3.0\npoll_interval_s = 0.1\n", workdir, redis,
                                          args.phase_s)
        finally:
            redis.stop()
    phases = {"sqlite": sqlite, "redis": redis_phase}
    totals = collections.Counter()
    for phase in phases.values():
        for key, count in phase["requests"].items():
            totals[key.split(":", 1)[1]] += count
    summary = {
        "hung": totals["hung"], "answered": totals["answered"], "failed_cleanly": totals["failed_cleanly"],
        "failed_unclean": totals["failed_unclean"] + totals["failed_internal"] + totals["connection_error"],
        "cut_by_gateway_kill": totals["cut_by_gateway_kill"],
        "jobs_lost": sum(p["jobs"]["lost"] for p in phases.values()),
        "jobs_run_twice": sum(p["jobs"]["run_twice"] for p in phases.values()),
        "jobs_stuck": sum(p["jobs"]["stuck"] for p in phases.values()),
        "batch_lines_missing_or_duplicated": sum(p["batch"]["missing_lines"] + p["batch"]["duplicated_lines"]
                                                 for p in phases.values()),
        "kv_blocks_after": sum(p["after"]["used_kv_blocks"] for p in phases.values()),
        "max_gateway_rss_ratio": max(p["gateway_rss_ratio"] for p in phases.values()),
    }
    summary["targets_met"] = (summary["hung"] == 0 and summary["jobs_lost"] == 0 and summary["jobs_run_twice"] == 0
                              and summary["jobs_stuck"] == 0 and summary["batch_lines_missing_or_duplicated"] == 0
                              and summary["kv_blocks_after"] == 0 and summary["max_gateway_rss_ratio"] <= 1.1)
    return {"what": "chaos bench: steady mixed load, faults injected, two phases (jobs in SQLite, in Redis)",
            "worker_backend": "sim (roofline SIMULATOR)" if args.backend == "sim" else args.backend,
            "phase_s": args.phase_s, "summary": summary, "phases": phases}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=150.0, help="seconds of injected load per phase")
    parser.add_argument("--backend", choices=["sim", "cpu"], default="sim", help="worker backend")
    result = asyncio.run(main_async(parser.parse_args()))
    write_result("chaos", result)
    return result


if __name__ == "__main__":
    main()
