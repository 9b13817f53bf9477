"""Serving throughput on the CPU: Sluice streaming through the gateway vs transformers' ``generate``.

Same prompts (MT-Bench first turns, chat-templated), 128 new tokens each (``ignore_eos``), fp32:
- Sluice: aggregate output tokens/s at 1, 16 and 32 concurrent streams; TTFT p50/p99; the gateway's own overhead
  per request (gateway TTFT − the worker's time to first token, from ``sluice_gateway_overhead_seconds``).
- transformers: ``generate(do_sample=False)`` at batch 1 and a static (left-padded) batch of 32.
The two never run at the same time (2 cores). JSON to bench/results/serving.json.

Run: ``.venv/bin/python -m bench.serving_bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from bench.common import mt_bench_prompts, percentile, sluice_server, write_result

NEW_TOKENS = 128
CONFIG = """
[model]
max_model_len_tokens = 2048
[gateway]
max_tokens_cap = 512
[worker]
backend = "cpu"
kv_cache_gib = 0.5
max_num_seqs = 32
max_num_batched_tokens = 512
num_threads = 2
"""


async def _stream_one(session: aiohttp.ClientSession, base_url: str, prompt: str) -> dict:
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
    async with session.post(base_url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft_s is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": ttft_s, "e2e_s": time.perf_counter() - start, "completion_tokens": completion_tokens}


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


def run_sluice(prompts: list[str], levels: list[int]) -> dict:
    with sluice_server(CONFIG) as base_url:
        asyncio.run(_run_concurrency(base_url, prompts, 1))  # warm-up
        runs = [asyncio.run(_run_concurrency(base_url, prompts, c)) for c in levels]
        return {"runs": runs, "gateway_overhead": _overhead_ms(base_url)}


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,16,32")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    prompts = mt_bench_prompts(max(levels))
    sluice = run_sluice(prompts, levels)
    baseline = run_transformers(prompts, sorted({1, max(levels)}))
    base = {r["batch_size"]: r["tokens_per_s"] for r in baseline}
    ours = {r["concurrency"]: r["tokens_per_s"] for r in sluice["runs"]}
    result = {
        "new_tokens": NEW_TOKENS,
        "sluice": sluice,
        "transformers": baseline,
        "ratios": {
            "single_stream_vs_transformers_batch1": round(ours[1] / base[1], 3),
            f"{max(levels)}_streams_vs_transformers_batch{max(levels)}": round(ours[max(levels)] / base[max(levels)], 3),
        },
        "targets": {"single_stream": ">= 2.0", "max_streams": ">= 1.3", "gateway_overhead_p99_ms": "< 5"},
    }
    write_result("serving", result)
    return result


if __name__ == "__main__":
    main()
