"""End-to-end decode tokens/s and TTFT on a GPU: ``sluice serve`` with a CUDA worker, streamed through HTTP.

Starts ``python -m sluice.cli serve`` with a CUDA worker (the synthetic Llama-3-8B of ``model.synthetic`` by
default: random weights of the real shape, no download; attention backend ``auto`` → the CuPy kernel; CUDA graphs
on; admission off so that nothing is shed), waits for ``/readyz``, warms up, then streams completions from 1 and
from 64 concurrent clients. A synthetic model is sent token-id prompts through ``/v1/completions`` (its tokenizer
maps token ``i`` to the word ``<i>``); a real model (``--model ""``) is sent a chat prompt through
``/v1/chat/completions``. Every stream decodes ``max_tokens`` tokens (``ignore_eos``). For each concurrency:

- ``decode_tokens_per_s``: completion tokens after each stream's first ÷ (last token time − first token time,
  over all streams): the decode rate of the whole server;
- ``per_stream_tokens_per_s``: mean over streams of (tokens − 1) ÷ (own last − own first token time);
- ``end_to_end_tokens_per_s``: all completion tokens ÷ wall time from the first request to the last token;
- TTFT percentiles in ms.

Usage: ``python bench/gpu_e2e.py [--out PATH] [--streams 1,64] [--max-tokens N] [--model llama-3-8b]``; JSON to
PATH (default ``$OUT/gpu_e2e.json``, else ``bench/results/gpu_e2e.json``) and stdout. ``--dry-run`` imports the
gateway and worker, checks the arguments and writes ``{"skipped": ...}``. Exit 0 on success, 1 on a failed run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.support.server import SluiceProcess, free_port  # noqa: E402
READY_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 240.0
PROMPT_TOKENS = 128
PROMPT = "Write a long, detailed story about a lighthouse keeper who discovers a hidden library under the sea."


def start_server(port: int, log_path: Path, backend: str, synthetic: str) -> SluiceProcess:
    """Start ``sluice serve`` (the repository's config.toml) on ``port``, logging to ``log_path``; do not wait."""
    env = {
        "SLUICE_WORKER__BACKEND": backend,
        "SLUICE_WORKER__KV_CACHE_GIB": os.environ.get("SLUICE_WORKER__KV_CACHE_GIB", "8"),
        "SLUICE_WORKER__MAX_NUM_SEQS": os.environ.get("SLUICE_WORKER__MAX_NUM_SEQS", "64"),
        "SLUICE_WORKER__MAX_NUM_BATCHED_TOKENS": "4096",
        "SLUICE_MODEL__SYNTHETIC": f'"{synthetic}"',
        "SLUICE_ADMISSION__ENABLED": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1",
    }
    server = SluiceProcess(None, port=port, args=["--host", "127.0.0.1"], env=env, ready="none", log_path=log_path,
                           inherit_sluice_env=True)
    return server.start()


def stop_server(server: SluiceProcess) -> None:
    """SIGTERM the server (it stops its workers), SIGKILL its process group after 15 s."""
    server.stop(timeout_s=15.0)


async def wait_ready(session: aiohttp.ClientSession, base: str, proc: subprocess.Popen) -> str:
    """Wait for ``/readyz`` then return the first model id of ``/v1/models``."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice serve exited with code {proc.returncode} before it was ready")
        try:
            async with session.get(f"{base}/readyz") as resp:
                if resp.status == 200:
                    async with session.get(f"{base}/v1/models") as models:
                        return (await models.json())["data"][0]["id"]
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)
    raise TimeoutError(f"sluice serve not ready after {READY_TIMEOUT_S:.0f} s")


def token_prompt(index: int) -> list[int]:
    """Return the token-id prompt of stream ``index``: PROMPT_TOKENS ids below 128000 (Llama 3's plain tokens),
    different per stream so that no prefix is cached."""
    return [(index * 7919 + t * 104729) % 128000 for t in range(PROMPT_TOKENS)]


async def stream_one(session: aiohttp.ClientSession, base: str, model: str, max_tokens: int,
                     index: int = 0, token_ids: bool = True) -> dict[str, Any]:
    """Stream one completion (token ids to ``/v1/completions``, else a chat prompt to ``/v1/chat/completions``);
    return token arrival times (s, monotonic) and the usage counts."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if token_ids:
        body["prompt"] = token_prompt(index)
        path = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
        path = "/v1/chat/completions"
    sent = time.monotonic()
    token_times: list[float] = []
    usage: dict[str, Any] = {}
    async with session.post(f"{base}{path}", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text") or choice.get("delta", {}).get("content"):
                    token_times.append(time.monotonic())
    return {"sent": sent, "token_times": token_times, "usage": usage}


async def run_concurrency(
    session: aiohttp.ClientSession, base: str, model: str, streams: int, max_tokens: int, token_ids: bool
) -> dict[str, Any]:
    """Run ``streams`` concurrent streams and summarise their decode rates."""
    started = time.monotonic()
    results = await asyncio.gather(*(stream_one(session, base, model, max_tokens, streams * 1000 + i, token_ids)
                                     for i in range(streams)))
    completion_tokens = [r["usage"].get("completion_tokens", len(r["token_times"])) for r in results]
    firsts = [r["token_times"][0] for r in results if r["token_times"]]
    lasts = [r["token_times"][-1] for r in results if r["token_times"]]
    decode_tokens = sum(max(0, n - 1) for n in completion_tokens)
    window_s = max(lasts) - min(firsts) if firsts else 0.0
    per_stream = [
        (n - 1) / (r["token_times"][-1] - r["token_times"][0])
        for r, n in zip(results, completion_tokens, strict=True)
        if len(r["token_times"]) > 1 and r["token_times"][-1] > r["token_times"][0]
    ]
    ttft_ms = sorted((r["token_times"][0] - r["sent"]) * 1e3 for r in results if r["token_times"])
    return {
        "streams": streams,
        "max_tokens": max_tokens,
        "completion_tokens": sum(completion_tokens),
        "decode_tokens_per_s": decode_tokens / window_s if window_s > 0 else None,
        "per_stream_tokens_per_s": statistics.mean(per_stream) if per_stream else None,
        "end_to_end_tokens_per_s": sum(completion_tokens) / (max(lasts) - started) if lasts else None,
        "ttft_ms_p50": ttft_ms[len(ttft_ms) // 2] if ttft_ms else None,
        "ttft_ms_max": ttft_ms[-1] if ttft_ms else None,
        "wall_s": time.monotonic() - started,
    }


async def bench(port: int, max_tokens: int, concurrencies: list[int], proc: subprocess.Popen,
                token_ids: bool) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}"
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = await wait_ready(session, base, proc)
        await stream_one(session, base, model, 8, 0, token_ids)  # warm-up: CUDA init, first steps
        await run_concurrency(session, base, model, 8, 16, token_ids)
        runs = [await run_concurrency(session, base, model, streams, max_tokens, token_ids)
                for streams in concurrencies]
    return {"model": model, "runs": runs}


def _default_out_path() -> Path:
    out_dir = os.environ.get("OUT")
    return Path(out_dir) / "gpu_e2e.json" if out_dir else REPO_ROOT / "bench" / "results" / "gpu_e2e.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens each stream decodes")
    parser.add_argument("--streams", default="1,64", help="comma-separated concurrencies to measure")
    parser.add_argument("--backend", default="cuda", help="worker backend (cuda; cpu only to smoke-test this script)")
    parser.add_argument("--log", type=Path, default=None, help="server log (default: beside the JSON)")
    parser.add_argument("--model", default="llama-3-8b",
                        help='model.synthetic of the served model; "" serves config.toml\'s model with chat prompts')
    parser.add_argument("--dry-run", action="store_true", help="import and check, start nothing")
    args = parser.parse_args(argv)
    concurrencies = [int(n) for n in args.streams.split(",")]
    out_path = args.out or _default_out_path()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        import gateway.app  # noqa: F401 - what the server imports
        import worker.__main__  # noqa: F401
        from shared.synthetic_models import synthetic_shape

        if args.model:
            synthetic_shape(args.model)
        report = {"skipped": "no GPU (dry run)", "model": args.model, "streams": concurrencies}
        out_path.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report))
        return 0
    log_path = args.log or out_path.with_name("gpu_e2e_server.log")
    port = free_port()
    server = start_server(port, log_path, args.backend, args.model)
    proc = server.process
    report: dict[str, Any] = {"backend": args.backend, "synthetic": args.model or "no (config.toml)",
                              "prompt": f"{PROMPT_TOKENS} token ids" if args.model else "chat",
                              "attention_backend": "auto (cupy on CUDA when CuPy imports)"}
    status = 0
    try:
        report.update(asyncio.run(bench(port, args.max_tokens, concurrencies, proc, bool(args.model))))
    except Exception as exc:  # noqa: BLE001 - the report says what failed; the exit code says that it did
        report["error"] = f"{type(exc).__name__}: {exc}"
        status = 1
    finally:
        stop_server(server)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if status:
        print(f"gpu_e2e failed; server log: {log_path}", file=sys.stderr)
        print(log_path.read_text()[-4000:], file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
