"""Serving throughput on the CPU: Sluice streaming through the gateway vs llama.cpp's ``llama-server`` on the same
GGUF file vs transformers' ``generate``.

Same prompts (MT-Bench first turns, chat-templated by each server), 128 new tokens each (``ignore_eos``), the same
streaming client for both servers, levels 1, 16 and 32 concurrent streams (one request per stream), each level
repeated 3 times (medians):

- Sluice (``model.weights`` ``auto``: int4 for the Q4_1 file; ``--weights`` adds other modes): aggregate output
  tokens/s, TTFT p50/p99, the gateway's own overhead per request. The bench config has one tier that may use every
  sequence slot (no slots reserved for a higher tier) and a queue timeout longer than the run.
- llama.cpp (``--llama-server PATH``; ``make peers`` builds it): ``--parallel 32 -t 2 --cont-batching``, the
  same file.
- transformers: ``generate(do_sample=False)`` at batch 1 and a static (left-padded) batch of 32 (``--no-transformers``
  skips it).

The engines never run at the same time (2 cores). JSON to bench/results/serving.json, with the ratios Sluice ÷
llama.cpp per level.

Run: ``.venv/bin/python -m bench.serving_bench --llama-server /work/peers/llama-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp

from bench.common import free_port, mt_bench_prompts, percentile, sluice_server, sse_chunks, write_result

NEW_TOKENS = 128
REPEATS = 3
CONFIG = """
default_tier = "bench"
[model]
max_model_len_tokens = 2048
weights = "{weights}"
[gateway]
max_tokens_cap = 512
[worker]
backend = "cpu"
kv_cache_gib = 0.5
max_num_seqs = 32
max_num_batched_tokens = 512
num_threads = 2
[[tiers]]
name = "bench"
priority = 1
queue_capacity = 1024
queue_timeout_s = 600.0
default_max_tokens = 512
max_tokens = 2048
"""


async def _stream_one(session: aiohttp.ClientSession, base_url: str, prompt: str) -> dict:
    """Stream one chat completion; return its TTFT (first content delta), end-to-end time and output tokens
    (the server's usage, else the number of content deltas: both servers send one token per delta)."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft_s = None
    completion_tokens = 0
    deltas = 0
    async with session.post(base_url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in sse_chunks(response):
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                deltas += 1
                if ttft_s is None:
                    ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": ttft_s, "e2e_s": time.perf_counter() - start,
            "completion_tokens": completion_tokens or deltas}


async def _run_concurrency(base_url: str, prompts: list[str], concurrency: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream_one(session, base_url, p) for p in prompts[:concurrency]))
        wall_s = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in results)
    ttfts = [r["ttft_s"] * 1000 for r in results if r["ttft_s"] is not None]
    return {
        "concurrency": concurrency,
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2),
        "ttft_ms_p50": round(percentile(ttfts, 50), 1),
        "ttft_ms_p99": round(percentile(ttfts, 99), 1),
    }


def _overhead_ms(base_url: str) -> dict:
    """p50/p99 of the gateway overhead histogram, interpolated within Prometheus buckets."""
    import urllib.request

    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith("sluice_gateway_overhead_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0

    def quantile(q: float) -> float:
        target = q * total
        prev_le, prev_count = 0.0, 0.0
        for le, count in buckets:
            if count >= target:
                if le == float("inf"):
                    return prev_le * 1000
                frac = (target - prev_count) / (count - prev_count) if count > prev_count else 0.0
                return (prev_le + (le - prev_le) * frac) * 1000
            prev_le, prev_count = le, count
        return float("nan")

    return {"count": int(total), "p50_ms": round(quantile(0.5), 3), "p99_ms": round(quantile(0.99), 3)}


def _levels_with_repeats(base_url: str, prompts: list[str], levels: list[int], repeats: int) -> list[dict]:
    """Run every level ``repeats`` times (levels interleaved), return per level the medians and the raw runs."""
    asyncio.run(_run_concurrency(base_url, prompts, 1))  # warm-up
    raw: dict[int, list[dict]] = {c: [] for c in levels}
    for _ in range(repeats):
        for c in levels:
            raw[c].append(asyncio.run(_run_concurrency(base_url, prompts, c)))
    out = []
    for c in levels:
        runs = raw[c]
        out.append({
            "concurrency": c,
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
            "ttft_ms_p50": round(statistics.median(r["ttft_ms_p50"] for r in runs), 1),
            "ttft_ms_p99": round(statistics.median(r["ttft_ms_p99"] for r in runs), 1),
            "completion_tokens": runs[0]["completion_tokens"],
            "runs": runs,
        })
    return out


def run_sluice(prompts: list[str], levels: list[int], weights: str = "auto", repeats: int = REPEATS) -> dict:
    config = CONFIG.format(weights=weights)
    start = time.perf_counter()
    with sluice_server(config) as base_url:
        ready_s = time.perf_counter() - start
        runs = _levels_with_repeats(base_url, prompts, levels, repeats)
        return {"weights": weights, "ready_s": round(ready_s, 2), "runs": runs,
                "gateway_overhead": _overhead_ms(base_url)}


# Where the CPU advertises AMX but the machine does not run AMX instructions (a VM that does not pass the tile state
# through), llama.cpp's AMX kernels, used for repacked weights, die of SIGILL or SIGSEGV on the first matrix product
# (gdb: ``tilezero`` in ``tinygemm_kernel_amx``). Without repacking llama.cpp runs the same quantized dot products on
# AVX-512 (Q4_1 has no other repacked layout on x86).
CRASH_FALLBACK_ARGS = ["--no-repack"]
LLAMA_SERVER_ARGS: list[str] = []  # what the last llama_server() ran with beyond its defaults (results record it)


@contextlib.contextmanager
def llama_server(binary: str, model_path: str, parallel: int, threads: int = 2, ctx_per_slot: int = 2048,
                 extra_args: list[str] | None = None):
    """Run ``llama-server`` on the GGUF file on a free port (with ``extra_args``, e.g. ``--metrics``); yield its
    base URL; stop it afterwards. A server killed by a signal before it is ready is started again with
    :data:`CRASH_FALLBACK_ARGS` (said on stderr; :data:`LLAMA_SERVER_ARGS` holds what ran)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "llama.log")
        args = list(extra_args or [])
        while True:
            cmd = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
                   "-t", str(threads), "--cont-batching", "-c", str(parallel * ctx_per_slot), *args]
            proc, base_url = _start_llama_server(cmd, log_path, port)
            if proc.returncode is None or proc.returncode >= 0 or CRASH_FALLBACK_ARGS[0] in args:
                break
            print(f"llama-server died of signal {-proc.returncode} before it was ready (AMX kernels on a machine "
                  f"that does not run them?); again with {' '.join(CRASH_FALLBACK_ARGS)}", file=sys.stderr)
            args += CRASH_FALLBACK_ARGS
        LLAMA_SERVER_ARGS[:] = args
        try:
            if proc.returncode is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}): {open(log_path).read()[-3000:]}")
            yield base_url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _start_llama_server(cmd: list[str], log_path: str, port: int) -> tuple[subprocess.Popen, str]:
    """Start ``cmd``; return it once ``/health`` answers 200, or once it has exited (``returncode`` set)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while proc.poll() is None:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError("llama-server did not become ready")
        time.sleep(0.5)
    return proc, base_url


def run_llama(binary: str, prompts: list[str], levels: list[int], repeats: int = REPEATS) -> dict:
    from shared.config import default_model_path

    start = time.perf_counter()
    with llama_server(binary, default_model_path(), parallel=max(levels)) as base_url:
        ready_s = time.perf_counter() - start
        runs = _levels_with_repeats(base_url, prompts, levels, repeats)
        return {"binary": binary, "ready_s": round(ready_s, 2),
                "args": " ".join([f"--parallel {max(levels)} -t 2 --cont-batching", *LLAMA_SERVER_ARGS]), "runs": runs}


def run_transformers(prompts: list[str], batch_sizes: list[int]) -> list[dict]:
    import torch
    from shared.config import default_model_path
    from shared.model_files import load_causal_lm, load_tokenizer

    torch.set_num_threads(2)
    path = default_model_path()
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    model = load_causal_lm(path, torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    results = []
    for batch_size in batch_sizes:
        batch = tokenizer(texts[:batch_size], return_tensors="pt", padding=True)
        with torch.inference_mode():
            model.generate(**tokenizer(texts[:1], return_tensors="pt"), max_new_tokens=4, do_sample=False)
            start = time.perf_counter()
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            wall_s = time.perf_counter() - start
        tokens = (out.shape[1] - batch["input_ids"].shape[1]) * batch_size
        results.append({"batch_size": batch_size, "completion_tokens": tokens, "wall_s": round(wall_s, 3),
                        "tokens_per_s": round(tokens / wall_s, 2)})
    return results


def _ratios(result: dict, levels: list[int]) -> dict:
    """Sluice ÷ llama.cpp (tok/s and TTFT p50) per level and mode, and Sluice ÷ transformers where both ran."""
    ratios: dict = {}
    for mode, run in result["sluice"].items():
        ours = {r["concurrency"]: r for r in run["runs"]}
        if "llama_cpp" in result:
            peer = {r["concurrency"]: r for r in result["llama_cpp"]["runs"]}
            for c in levels:
                ratios[f"sluice_{mode}_vs_llama_cpp_tok_s_{c}"] = round(
                    ours[c]["tokens_per_s"] / peer[c]["tokens_per_s"], 3)
                ratios[f"sluice_{mode}_vs_llama_cpp_ttft_p50_{c}"] = round(
                    ours[c]["ttft_ms_p50"] / peer[c]["ttft_ms_p50"], 3)
        for row in result.get("transformers", []):
            c = row["batch_size"]
            if c in ours:
                ratios[f"sluice_{mode}_vs_transformers_batch{c}"] = round(ours[c]["tokens_per_s"] / row["tokens_per_s"], 3)
    return ratios


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,16,32")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--weights", default="auto", help="comma-separated model.weights modes of Sluice to run")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""),
                        help="path of llama.cpp's llama-server binary (peer in the same run)")
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    prompts = mt_bench_prompts(max(levels))
    result: dict = {
        "new_tokens": NEW_TOKENS, "repeats": args.repeats, "sluice": {},
        "targets": {"vs_llama_cpp_tok_s_16_and_32": ">= 1.0", "vs_llama_cpp_tok_s_1": ">= 0.6",
                    "vs_llama_cpp_ttft_p50_16": "<= 1.0 (lower is better)", "gateway_overhead_p99_ms": "< 5"},
    }

    def save() -> None:  # after every engine, so a later failure keeps what was measured
        result["ratios"] = _ratios(result, levels)
        write_result("serving", result)

    modes = args.weights.split(",")
    result["sluice"][modes[0]] = run_sluice(prompts, levels, modes[0], args.repeats)
    save()
    if args.llama_server:
        result["llama_cpp"] = run_llama(args.llama_server, prompts, levels, args.repeats)
        save()
    if not args.no_transformers:
        result["transformers"] = run_transformers(prompts, sorted({1, max(levels)}))
        save()
    for mode in modes[1:]:
        result["sluice"][mode] = run_sluice(prompts, levels, mode, args.repeats)
        save()
    return result


if __name__ == "__main__":
    main()
