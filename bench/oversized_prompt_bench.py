"""What prompts far past the context cost the gateway: memory (RSS) and time to the 400.

Starts ``sluice serve`` with one sim worker (the roofline SIMULATOR: no model in memory; the tokenizer, which is
what these requests exercise, is the real one) and the default 8,192-token context, warms it with a few small chats,
reads the gateway process's RSS, then sends ``--parallel`` chat requests at once, each with a ``--prompt-kb`` KB
message of English prose, and reads the RSS while they run, when they are answered, and ``--settle-s`` seconds
later. Every one must be a 400 ``context_length_exceeded``.

Usage::

    .venv/bin/python -m bench.oversized_prompt_bench [--parallel 8] [--prompt-kb 600] [--settle-s 30]

Writes ``bench/results/oversized_prompts.json``: RSS in MB (baseline, peak, after answering, after settling, and
settled ÷ baseline), each request's status and seconds to its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from bench.common import write_result
from tests.support.server import SluiceProcess

MODEL = "SmolLM2-135M-Instruct"
CONFIG = """
[worker]
num_local_workers = 1
backend = "sim"
"""
PROSE = "The river bends past the mill and the baker waves to the miller's children. "
RSS_POLL_INTERVAL_S = 0.05


def rss_mb(pid: int) -> float:
    """Return the resident set size of process ``pid`` in MB (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for process {pid}")


async def chat(session: aiohttp.ClientSession, url: str, content: str) -> tuple[int, str, float]:
    started_s = time.perf_counter()
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        payload = await response.json()
        code = payload["error"]["code"] if "error" in payload else "ok"
        return response.status, code, time.perf_counter() - started_s


async def measure(server: SluiceProcess, parallel: int, prompt_kb: int, settle_s: float) -> dict:
    pid = server.process.pid
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in range(4):
            await chat(session, server.base_url, f"Say hello number {i}.")
        await asyncio.sleep(2.0)
        baseline_mb = rss_mb(pid)
        content = (PROSE * (prompt_kb * 1024 // len(PROSE) + 1))[:prompt_kb * 1024]
        peak_mb = baseline_mb
        tasks = [asyncio.create_task(chat(session, server.base_url, content)) for _ in range(parallel)]
        while not all(task.done() for task in tasks):
            peak_mb = max(peak_mb, rss_mb(pid))
            await asyncio.sleep(RSS_POLL_INTERVAL_S)
        replies = [task.result() for task in tasks]
        answered_mb = rss_mb(pid)
        await asyncio.sleep(settle_s)
        settled_mb = rss_mb(pid)
    return {
        "parallel": parallel, "prompt_bytes": len(content.encode()), "settle_s": settle_s,
        "rss_mb": {"baseline": round(baseline_mb, 1), "peak": round(peak_mb, 1), "answered": round(answered_mb, 1),
                   "settled": round(settled_mb, 1)},
        "settled_over_baseline": round(settled_mb / baseline_mb, 3),
        "replies": [{"status": status, "code": code, "seconds": round(seconds, 3)} for status, code, seconds in replies],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--prompt-kb", type=int, default=600)
    parser.add_argument("--settle-s", type=float, default=30.0)
    parser.add_argument("--name", default="oversized_prompts", help="result file name under bench/results/")
    args = parser.parse_args(argv)
    with SluiceProcess(CONFIG, start_timeout_s=300) as server:
        result = asyncio.run(measure(server, args.parallel, args.prompt_kb, args.settle_s))
    write_result(args.name, result)
    bad = [r for r in result["replies"] if (r["status"], r["code"]) != (400, "context_length_exceeded")]
    print(json.dumps({"not_400_context_length_exceeded": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
