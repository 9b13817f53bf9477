"""KV lifetime end to end on the real model (SmolLM2-135M, fp32, CPU): reuse, offload tiers, preemption.

Greedy output must be identical token for token however a prompt's KV got into the pool: computed from scratch, hit
on the device, reloaded from host RAM, disk or Redis (the real server at 127.0.0.1:6379), or restored after a swap
or a recompute preemption. Each case runs a returning conversation (turn 1, its KV pushed off the device by another
request, then turn 2 = history + answer + a new user turn) and compares turn 2 with a fresh engine's answer.
"""

from __future__ import annotations

import random
import uuid

import pytest
import torch
from structlog.testing import capture_logs

from shared.config import KVConfig, default_model_path
from shared.protocol import Generate, SamplingParams
from worker.engine import Engine
from worker.kv_cache.manager import KVCacheManager
from worker.kv_cache.offload.chain import build_offload_chain
from worker.kv_cache.offload.redis_tier import redis_key_prefix
from worker.model import load_model
from worker.model_runner import ModelRunner
from worker.scheduler import Scheduler
from tests.support.server import free_port

BS = 16
NUM_NEW_TOKENS = 16
REDIS_URL = "redis://127.0.0.1:6379/0"
VIP = 3  # tier priority of every request here: retained at every pressure level


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    try:
        path = default_model_path()
    except Exception as exc:
        pytest.skip(f"default model not installed: {exc}")
    return load_model(path, torch.float32, "cpu")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def make_engine(model, num_blocks: int, kv: KVConfig | None = None, model_id: str = "smollm2") -> Engine:
    """An engine over a ``num_blocks`` pool; with ``kv`` the offload chain it configures, else none."""
    kv_cache = model.allocate_kv_cache(num_blocks, BS)
    runner = ModelRunner(model, kv_cache, BS, torch.device("cpu"))
    offload = build_offload_chain(kv, runner.block_io, model_id, "float32") if kv is not None else None
    manager = KVCacheManager(num_blocks, BS, config=kv or KVConfig(), offload=offload)
    return Engine(Scheduler(manager, 4, 512, 2048), runner, model.spec.eos_token_ids)


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int | dict[str, int] = NUM_NEW_TOKENS,
        priorities: dict[str, int] | None = None) -> dict[str, tuple[list[int], int]]:
    """Serve ``prompts`` together; return ``{request_id: (output token ids, cached_tokens)}``."""
    for request_id, prompt in prompts.items():
        num = max_tokens if isinstance(max_tokens, int) else max_tokens[request_id]
        msg = Generate(request_id, prompt, SamplingParams(temperature=0.0), num, ignore_eos=True)
        engine.add(request_id, msg, (priorities or {}).get(request_id, VIP))
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    while engine.has_work():
        for event in engine.step().events:
            outputs[event.request_id] += event.new_token_ids
            if event.finish_reason is not None:
                cached[event.request_id] = event.cached_tokens
    return {rid: (outputs[rid], cached[rid]) for rid in prompts}


_scratch: dict[tuple[int, ...], list[int]] = {}


def scratch(model, prompt: list[int]) -> list[int]:
    """The answer of a fresh engine with a roomy pool and no offload (memoized)."""
    key = tuple(prompt)
    if key not in _scratch:
        _scratch[key] = run(make_engine(model, 64), {"ref": prompt})["ref"][0]
    return _scratch[key]


def evict_all(engine: Engine, seed: int = 99) -> None:
    """Push cached blocks off the device: a 240-token prompt takes 15 of the 16 blocks."""
    run(engine, {f"evictor-{seed}": tokens(seed, 240)}, max_tokens=1)


def returning_conversation(model, engine: Engine, seed: int = 1, evict: bool = True) -> tuple[list[int], int, int]:
    """Turn 1, optionally evict, turn 2; return (turn 2 output, its cached_tokens, history length)."""
    history = tokens(seed, 100)
    answer, _ = run(engine, {f"turn1-{seed}": history})[f"turn1-{seed}"]
    assert answer == scratch(model, history)
    if evict:
        evict_all(engine, seed + 1000)
    turn2 = history + answer + tokens(seed + 500, 20)
    output, cached = run(engine, {f"turn2-{seed}": turn2})[f"turn2-{seed}"]
    return output, cached, len(history) + len(answer)


@pytest.fixture
def redis_model_id():
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379 (run `make redis`)")
    model_id = f"test-{uuid.uuid4().hex[:8]}"
    yield model_id
    for key in client.scan_iter(match=redis_key_prefix(model_id, "float32") + "*"):
        client.delete(key)
    client.close()


# ---------------------------------------------------------------- reuse and reload


@pytest.mark.parametrize("tier", ["device", "host", "disk", "redis"])
def test_returning_conversation_is_identical_whether_hit_on_device_or_reloaded(model, tier, tmp_path, request):
    model_id = request.getfixturevalue("redis_model_id") if tier == "redis" else "smollm2"
    configs = {
        "device": KVConfig(host_cache_gib=0, disk_cache_gib=0),
        "host": KVConfig(host_cache_gib=0.05, disk_cache_gib=0),
        "disk": KVConfig(host_cache_gib=0, disk_cache_gib=0.05, disk_cache_dir=str(tmp_path)),
        "redis": KVConfig(host_cache_gib=0, disk_cache_gib=0, redis_url=REDIS_URL),
    }
    engine = make_engine(model, 16, configs[tier], model_id)
    output, cached, num_history = returning_conversation(model, engine, evict=tier != "device")
    turn2 = tokens(1, 100) + scratch(model, tokens(1, 100)) + tokens(501, 20)
    assert output == scratch(model, turn2)
    assert cached >= 0.9 * num_history  # 112 of 116 history tokens: every full computed block
    stats = engine.scheduler.kv.stats_snapshot()
    if tier == "device":
        assert stats["prefix_hit_tokens{tier=device}"] == cached
    else:
        assert stats[f"prefix_hit_tokens{{tier={tier}}}"] >= 5 * BS  # most of it came back from the tier
        assert stats[f"reloaded_bytes{{tier={tier}}}"] > 0 and stats["reload_decisions_total"] == 1
    engine.scheduler.kv.offload.close()


@pytest.mark.parametrize("prefill_tokens_per_s, reloads", [(1.0, True), (1e12, False)])
def test_cost_model_decision_pins_reload_or_recompute_and_output_is_identical(model, prefill_tokens_per_s, reloads):
    engine = make_engine(model, 16, KVConfig(host_cache_gib=0.05, disk_cache_gib=0))
    engine.scheduler.kv.offload.cost.freeze(prefill_tokens_per_s=prefill_tokens_per_s,
                                            bandwidth_bytes_per_s={"host": 1e9})
    output, _, _ = returning_conversation(model, engine, seed=2)
    assert output == scratch(model, tokens(2, 100) + scratch(model, tokens(2, 100)) + tokens(502, 20))
    stats = engine.scheduler.kv.stats_snapshot()
    assert (stats["prefix_hit_tokens{tier=host}"] > 0) == reloads
    assert stats.get("reload_decisions_total", 0) == (1 if reloads else 0)
    assert stats.get("recompute_decisions_total", 0) == (0 if reloads else 1)


def test_two_conversations_sharing_a_prefix_never_see_each_others_continuation(model):
    engine = make_engine(model, 16, KVConfig(host_cache_gib=0.05, disk_cache_gib=0))
    system = tokens(7, 48)  # 3 full blocks shared
    first = {"a": system + tokens(8, 30), "b": system + tokens(9, 30)}
    out_a, _ = run(engine, {"a": first["a"]})["a"]
    out_b, cached_b = run(engine, {"b": first["b"]})["b"]
    assert cached_b == 48  # the shared system prompt, not a's continuation
    assert (out_a, out_b) == (scratch(model, first["a"]), scratch(model, first["b"]))
    evict_all(engine)
    second = {"a2": first["a"] + out_a + tokens(10, 12), "b2": first["b"] + out_b + tokens(11, 12)}
    results = run(engine, second)
    for rid, prompt in second.items():
        assert results[rid][0] == scratch(model, prompt)
        assert results[rid][1] >= 80  # each got its own history back (reloaded from host)


# ---------------------------------------------------------------- preemption


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequence_resumes_with_identical_output(model, mode):
    engine = make_engine(model, 7, KVConfig(host_cache_gib=0, disk_cache_gib=0, swap_space_gib=0.05))
    rate = 1.0 if mode == "swap" else 1e12  # recompute is slow → swap; instantaneous → recompute
    engine.scheduler.kv.offload.cost.freeze(prefill_tokens_per_s=rate, bandwidth_bytes_per_s={"host": 1e9})
    # low takes the last free block at its token 48; high needs a 4th block at its token 48: low (mid-block, 52
    # tokens computed) is the victim; high then grows to 6 blocks, evicting low's cached blocks while it waits
    prompts = {"high": tokens(20, 40), "low": tokens(21, 44)}
    max_tokens = {"high": 56, "low": 24}
    results = run(engine, prompts, max_tokens=max_tokens, priorities={"high": 3, "low": 2})
    stats = engine.scheduler.kv.stats_snapshot()
    assert stats[f"preemptions{{mode={mode}}}"] >= 1
    assert stats[f"preemptions{{mode={'recompute' if mode == 'swap' else 'swap'}}}"] == 0
    if mode == "swap":
        assert stats["swapped_in_bytes"] > 0 and stats["swapped_in_bytes"] <= stats["swapped_out_bytes"]
    for rid, prompt in prompts.items():
        assert results[rid][0] == run(make_engine(model, 64), {rid: prompt}, max_tokens=max_tokens)[rid][0]
    assert engine.scheduler.kv.num_used_blocks == 0 and engine.scheduler.kv.offload.swap.used_bytes == 0


# ---------------------------------------------------------------- Redis down


def test_redis_down_serving_continues_by_recompute_with_metric_and_one_log_line(model):
    port = free_port()  # nothing listens there
    kv = KVConfig(host_cache_gib=0, disk_cache_gib=0, redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.2,
                  redis_retry_s=0.0)
    engine = make_engine(model, 16, kv)
    with capture_logs() as logs:
        output, cached, _ = returning_conversation(model, engine, seed=3)
    assert output == scratch(model, tokens(3, 100) + scratch(model, tokens(3, 100)) + tokens(503, 20))
    stats = engine.scheduler.kv.stats_snapshot()
    assert stats["redis_errors_total"] >= 1 and stats["redis_up"] == 0.0
    assert stats["prefix_hit_tokens{tier=redis}"] == 0 and cached < 48  # recomputed, not reloaded
    assert [entry["event"] for entry in logs if entry["event"].startswith("kv_redis")] == ["kv_redis_unavailable"]
