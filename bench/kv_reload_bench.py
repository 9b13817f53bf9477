"""TTFT of a returning conversation whose KV was evicted from the device to host RAM, against a cold prefill.

Real model (the default SmolLM2-135M GGUF, fp32) on the CPU, the real engine, scheduler, KV manager and host tier.
For each history length: turn 1 runs, a long unrelated prompt pushes every cached block of it off the device pool
(demoted to host RAM), then turn 2 (history + answer + a new 32-token user turn) arrives. Three TTFTs of turn 2,
each the engine's worker-side time to its first token, median of ``--repeats``:

- ``cold``: a fresh engine without any cache prefills all of turn 2;
- ``host_reload``: the history comes back from host RAM (the cost model decides; it reloads on a CPU);
- ``device_hit``: no eviction, the history is still in the device pool (the floor).

Writes ``bench/results/kv_reload.json``.

    .venv/bin/python bench/kv_reload_bench.py [--history-tokens 256 512 1024] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from shared.config import KVConfig, default_model_path  # noqa: E402
from shared.protocol import Generate, SamplingParams  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.kv_cache.manager import KVCacheManager  # noqa: E402
from worker.kv_cache.offload.chain import build_offload_chain  # noqa: E402
from worker.model import load_model  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402
from worker.scheduler import Scheduler  # noqa: E402

BS = 16
NEW_TURN_TOKENS = 32
ANSWER_TOKENS = 16


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def make_engine(model, num_blocks: int, host_cache_gib: float) -> Engine:
    kv_config = KVConfig(host_cache_gib=host_cache_gib, disk_cache_gib=0, swap_space_gib=0)
    runner = ModelRunner(model, model.allocate_kv_cache(num_blocks, BS), BS, torch.device("cpu"))
    offload = build_offload_chain(kv_config, runner.block_io, "bench", "float32") if host_cache_gib else None
    manager = KVCacheManager(num_blocks, BS, config=kv_config, offload=offload)
    return Engine(Scheduler(manager, 4, 8192, 8192), runner, model.spec.eos_token_ids)


def serve(engine: Engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """Run one request alone; return (output, TTFT ms, cached tokens)."""
    # vip (priority 3): retained at every pressure level; with a pool this small, one long prompt is "elevated"
    engine.add(request_id, Generate(request_id, prompt, SamplingParams(temperature=0.0), max_tokens,
                                    tier="vip", ignore_eos=True), tier_priority=3)
    output: list[int] = []
    ttft_ms = 0.0
    cached = 0
    while engine.has_work():
        result = engine.step()
        ttft_ms = result.first_token_latency_ms.get(request_id, ttft_ms)
        for event in result.events:
            output += event.new_token_ids
            if event.finish_reason is not None:
                cached = event.cached_tokens
    return output, ttft_ms, cached


def one_run(model, history_tokens: int, seed: int) -> dict:
    history = tokens(seed, history_tokens)
    turn2_tail = tokens(seed + 1, NEW_TURN_TOKENS)
    num_blocks = (history_tokens + ANSWER_TOKENS + NEW_TURN_TOKENS + 1) // BS + 4
    result = {}
    for mode in ("host_reload", "device_hit"):
        engine = make_engine(model, num_blocks, host_cache_gib=1.0)
        answer, _, _ = serve(engine, "turn1", history, ANSWER_TOKENS)
        if mode == "host_reload":
            serve(engine, "evictor", tokens(seed + 2, (num_blocks - 1) * BS), 1)
        turn2 = history + answer + turn2_tail
        _, ttft_ms, cached = serve(engine, "turn2", turn2, 1)
        stats = engine.scheduler.kv.stats_snapshot()
        result[mode] = {"ttft_ms": ttft_ms, "cached_tokens": cached,
                        "host_hit_tokens": stats["prefix_hit_tokens{tier=host}"],
                        "reloaded_bytes": stats.get("reloaded_bytes{tier=host}", 0.0)}
        engine.scheduler.kv.offload.close()
    cold_engine = make_engine(model, num_blocks, host_cache_gib=0)
    _, ttft_ms, _ = serve(cold_engine, "cold", history + answer + turn2_tail, 1)
    result["cold"] = {"ttft_ms": ttft_ms, "cached_tokens": 0}
    result["turn2_prompt_tokens"] = len(history) + len(answer) + NEW_TURN_TOKENS
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history-tokens", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "kv_reload.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(default_model_path(), torch.float32, "cpu")
    serve(make_engine(model, 16, 0), "warmup", tokens(0, 64), 2)
    rows = []
    for history_tokens in args.history_tokens:
        runs = [one_run(model, history_tokens, seed=history_tokens + r) for r in range(args.repeats)]
        row = {"history_tokens": history_tokens, "turn2_prompt_tokens": runs[0]["turn2_prompt_tokens"]}
        for mode in ("cold", "host_reload", "device_hit"):
            row[f"{mode}_ttft_ms"] = statistics.median(run[mode]["ttft_ms"] for run in runs)
            row[f"{mode}_cached_tokens"] = runs[0][mode]["cached_tokens"]
        row["host_reload_host_hit_tokens"] = runs[0]["host_reload"]["host_hit_tokens"]
        row["host_reload_bytes"] = runs[0]["host_reload"]["reloaded_bytes"]
        row["speedup_host_reload_vs_cold"] = row["cold_ttft_ms"] / row["host_reload_ttft_ms"]
        rows.append(row)
        print(json.dumps(row))
    out = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)", "device": "cpu",
           "torch_threads": args.threads, "block_size_tokens": BS, "repeats": args.repeats,
           "new_turn_tokens": NEW_TURN_TOKENS, "answer_tokens": ANSWER_TOKENS,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
