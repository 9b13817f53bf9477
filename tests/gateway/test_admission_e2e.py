"""Overload behaviour end to end: real ``sluice serve`` gateways and sim-worker processes over loopback.

The sim backend (worker/backends/sim.py, a roofline SIMULATOR, slowed with ``sim.time_scale`` so that one decode
step takes about 0.1 s on any CPU) with ``max_num_seqs = 2`` makes a worker that saturates with two requests, so
the gateway's admission queues fill. Tiers, pressure thresholds and deadlines are small (``OVERLOAD_CONFIG``) so
that each rule shows within a second or two.

Worker-health tests run a second gateway connected (``--worker-address``) to a real sim worker, two worker test
doubles that speak the real protocol but stay silent or stall on command (tests/gateway/fake_worker.py), and an
address where nothing listens.

Named after the behaviour cases of ../shared/cases/gateway_cases.jsonl (BC03, BC20, BC25, BC26, BC28).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import pytest

from tests.conftest import HELPER_EXIT_TIMEOUT_S, _alive, _child_pids
from tests.support.server import ProcessExited, SluiceProcess, free_port, get_json
from tests.gateway.fake_worker import FakeWorker, FakeWorkers

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
STEP_S = 0.1  # one simulated decode step: (weights ÷ HBM bandwidth + overhead) × time_scale 15 ≈ 0.1 s

OVERLOAD_CONFIG = """
[model]
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 1024
default_max_tokens = 16
drain_timeout_s = 10.0

[worker]
backend = "sim"
max_num_seqs = 2
capacity_interval_s = 0.1

[sim]
time_scale = 15.0
kv_cache_gib = 0.25          # 128 blocks of 16 tokens (2 MiB each for the simulated 8B model)
max_model_len_tokens = 2048

[admission]
aging_rate_per_s = 0.5       # a standard request passes a fresh vip after 2 s of waiting

[[tiers]]
name = "vip"
priority = 3
queue_capacity = 8
queue_timeout_s = 20.0
default_max_tokens = 16
max_tokens = 1024
reserved_kv_fraction = 0.5   # 64 of the 128 blocks

[[tiers]]
name = "standard"
priority = 2
queue_capacity = 16
queue_timeout_s = 30.0
default_max_tokens = 16
max_tokens = 1024

[[tiers]]
name = "free"
priority = 1
queue_capacity = 2
queue_timeout_s = 30.0
default_max_tokens = 8
max_tokens = 12

[[tiers]]
name = "batch"
priority = 0
queue_capacity = 8
queue_timeout_s = 1.5
default_max_tokens = 16
max_tokens = 1024

[[api_keys]]
key = "sk-vip"
tenant = "vip-customer"
tier = "vip"

[[api_keys]]
key = "sk-limited"
tenant = "limited"
tier = "standard"
rpm_limit = 2

[pressure]
min_dwell_s = 1.0

[pressure.elevated]
enter_queue_wait_s = 2.0
leave_queue_wait_s = 1.0
enter_kv_used_fraction = 0.97
leave_kv_used_fraction = 0.9
max_tokens_by_tier = { vip = 6, standard = 6 }

[pressure.critical]
enter_queue_wait_s = 1000.0
leave_queue_wait_s = 900.0
enter_kv_used_fraction = 0.99
leave_kv_used_fraction = 0.98
"""

HEALTH_CONFIG = """
[model]
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 64
default_max_tokens = 8
first_token_timeout_s = 0.8
stall_timeout_s = 0.8
drain_timeout_s = 5.0

[worker]
backend = "sim"
max_num_seqs = 4
capacity_interval_s = 0.1

[sim]
time_scale = 5.0
kv_cache_gib = 0.25
max_model_len_tokens = 2048

[breaker]
failure_threshold = 2
cooldown_s = 1.5
"""


# ---------------------------------------------------------------------------------------------- processes


Gateway = SluiceProcess


def _start_gateway(workdir: Path, config_text: str, worker_addresses: list[str] = ()) -> Gateway:
    args = [arg for address in worker_addresses for arg in ("--worker-address", address)]
    return SluiceProcess(config_text, workdir, args=args, min_ready_workers=0).start(wait=False)


def _wait_ready(gateway: Gateway, timeout_s: float = 180.0) -> None:
    try:
        gateway.wait_ready(timeout_s)
    except ProcessExited as exc:
        pytest.fail(str(exc))


def _stop_gateway(gateway: Gateway) -> None:
    """Stop the gateway (SIGTERM, then SIGKILL) and kill any of its workers that outlive it."""
    workers = _child_pids(gateway.process.pid)
    gateway.stop()
    for pid in workers:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def overload(tmp_path_factory) -> Gateway:
    """A gateway with one local sim worker (max_num_seqs 2) and the small tiers of ``OVERLOAD_CONFIG``."""
    gateway = _start_gateway(tmp_path_factory.mktemp("overload"), OVERLOAD_CONFIG)
    try:
        _wait_ready(gateway)
        yield gateway
    finally:
        _stop_gateway(gateway)


# ---------------------------------------------------------------------------------------------- HTTP helpers


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float
    started_s: float = 0.0

    def json(self):
        return json.loads(self.body)

    @property
    def retry_after_s(self) -> int:
        return int(self.headers["retry-after"])

    @property
    def reject_reason(self) -> str | None:
        """The ``x-sluice-reject-reason`` header (every 429 / 503 names the body's code in it)."""
        return self.headers.get("x-sluice-reject-reason")

    @property
    def error_code(self) -> str:
        return self.json()["error"]["code"]

    def events(self) -> list:
        return [line[len(b"data: "):] for line in self.body.split(b"\n\n") if line.startswith(b"data: ")]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def _chat(content: str = "hi", **kwargs) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kwargs}


def _tier(tier: str) -> dict[str, str]:
    """Headers that put a request in ``tier``: vip needs its API key; lower tiers lower the default (standard)."""
    if tier == "vip":
        return {"Authorization": "Bearer sk-vip"}
    return {"x-sluice-tier": tier}


async def post(http: aiohttp.ClientSession, base_url: str, body: dict, path: str = CHAT,
               headers: dict[str, str] | None = None, on_first_byte: asyncio.Event | None = None) -> Reply:
    started_s = time.monotonic()
    async with http.post(base_url + path, json=body, headers=headers or {}) as response:
        chunks = []
        async for chunk in response.content.iter_any():
            if on_first_byte is not None:
                on_first_byte.set()
            chunks.append(chunk)
        return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, b"".join(chunks),
                     time.monotonic() - started_s, started_s)


async def stream_times(http: aiohttp.ClientSession, base_url: str, body: dict, headers: dict[str, str]) -> dict:
    """Stream a chat request; return the status and the times it was sent, of its first content token and of
    ``[DONE]``."""
    times = {"sent_s": time.monotonic(), "first_token_s": None, "done_s": None, "status": None, "queue_ms": None}
    async with http.post(base_url + CHAT, json={**body, "stream": True}, headers=headers) as response:
        times["status"] = response.status
        times["queue_ms"] = response.headers.get("x-sluice-queue-ms")
        async for line in response.content:
            if line.startswith(b"data: [DONE]"):
                times["done_s"] = time.monotonic()
            elif line.startswith(b"data: ") and times["first_token_s"] is None:
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    times["first_token_s"] = time.monotonic()
    return times


LONG_PROMPT = "Summarise the following text. " + "word " * 780  # 818 tokens with the chat template


class Saturation:
    """Long streaming requests in the background; cancelling them closes their connections (the gateway aborts)."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self.http = http
        self.base_url = base_url
        self.tasks: list[asyncio.Task] = []

    def add(self, tier: str, max_tokens: int, count: int = 1, content: str = "Write the numbers from 1 to 5000.") -> None:
        for _ in range(count):
            body = _chat(content, max_tokens=max_tokens, stream=True)
            self.tasks.append(asyncio.create_task(post(self.http, self.base_url, body, headers=_tier(tier))))

    async def release(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()


async def wait_status(gateway: Gateway, predicate, timeout_s: float = 10.0) -> dict:
    """Poll ``/status`` until ``predicate(status)``; fail with the last status otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await asyncio.to_thread(gateway.status)
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"/status never matched: {json.dumps(status)[:3000]}")
        await asyncio.sleep(0.05)


def tier_stats(status: dict, tier: str) -> dict:
    return status["admission"]["tiers"][tier]


def _idle(status: dict) -> bool:
    tiers = status["admission"]["tiers"].values()
    return all(t["queue_depth"] == 0 and t["in_flight"] == 0 for t in tiers) and status["active_requests"] == 0


async def settle(gateway: Gateway, timeout_s: float = 15.0) -> dict:
    """Wait until nothing is queued or running, the worker holds no KV and the pressure is back to normal."""
    return await wait_status(gateway, lambda s: _idle(s) and s["pressure"]["level"] == "normal"
                             and s["workers"][0]["capacity"]["num_running"] == 0, timeout_s)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


# ---------------------------------------------------------------------------------------------- admission


async def test_sim_worker_is_named_a_simulator_on_status_and_metrics(overload, http):
    status = overload.status()
    worker = status["workers"][0]
    assert worker["backend"] == "sim" and worker["simulator"] is True and worker["hello"]["device"] == "sim:roofline"
    async with http.get(overload.base_url + "/metrics") as response:
        text = await response.text()
    assert metric_value(text, "sluice_worker_ready", worker="local-0", backend="sim") == 1.0
    assert metric_value(text, "sluice_worker_info", backend="sim", device="sim:roofline") == 1.0
    assert metric_value(text, "sluice_breaker_state", worker="local-0", backend="sim") == 0.0
    assert metric_value(text, "sluice_pressure_level") == 0.0
    if worker["capacity"].get("kv_stats"):  # the worker's KV statistics, one gauge per Capacity.kv_stats key
        assert any(line.startswith("sluice_worker_kv_") and 'backend="sim"' in line for line in text.splitlines())
    for tier in ("vip", "standard", "free", "batch"):
        assert metric_value(text, "sluice_queue_depth", tier=tier) == 0.0
    reply = await post(http, overload.base_url, _chat(max_tokens=3))
    assert reply.status == 200 and float(reply.headers["x-sluice-queue-ms"]) >= 0.0


async def test_bc26_rate_limit_is_429_rate_limit_exceeded_with_retry_after(overload, http):
    key = {"Authorization": "Bearer sk-limited"}
    replies = [await post(http, overload.base_url, _chat(max_tokens=1), headers=key) for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 429]
    limited = replies[2]
    assert limited.error_code == "rate_limit_exceeded" and limited.json()["error"]["type"] == "rate_limit_error"
    assert limited.reject_reason == "rate_limit_exceeded"
    assert 1 <= limited.retry_after_s <= 31  # one request of 2 per minute refills in 30 s
    status = overload.status()
    assert tier_stats(status, "standard")["rejected"]["rate_limit_exceeded"] >= 1


async def test_bc25_bc26_queue_full_is_503_queue_full_with_retry_after_and_json_not_sse(overload, http):
    await settle(overload)
    saturation = Saturation(http, overload.base_url)
    saturation.add("free", max_tokens=12, count=2)  # running (max_num_seqs 2)
    await wait_status(overload, lambda s: tier_stats(s, "free")["in_flight"] == 2)
    saturation.add("free", max_tokens=12, count=2)  # fill the free queue (capacity 2)
    try:
        status = await wait_status(overload, lambda s: tier_stats(s, "free")["queue_depth"] == 2)
        a = await post(http, overload.base_url, _chat(max_tokens=4), headers=_tier("free"))
        b = await post(http, overload.base_url, _chat(max_tokens=4, stream=True), headers=_tier("free"))
        repeats = await asyncio.gather(*(post(http, overload.base_url, _chat(max_tokens=4), headers=_tier("free"))
                                         for _ in range(10)))
        for reply in (a, b, *repeats):
            assert reply.status == 503 and reply.error_code == "queue_full", reply.body
            assert reply.reject_reason == "queue_full"
            assert reply.headers["retry-after"].isdigit() and reply.retry_after_s >= 1
            assert reply.elapsed_s < 1.0  # at once, not after waiting
        assert b.headers["content-type"].startswith("application/json") and not b.body.startswith(b"data:")
        # Retry-After is the drain time of the queue at the measured rate, not a constant (BC25)
        predicted_s = tier_stats(status, "free")["predicted_wait_s"]
        assert predicted_s is not None and predicted_s > 0
        assert abs(a.retry_after_s - predicted_s) <= max(3.0, 0.5 * predicted_s), (a.retry_after_s, predicted_s)
    finally:
        await saturation.release()
    status = await wait_status(overload, lambda s: tier_stats(s, "free")["queue_depth"] == 0, 2.0)
    assert tier_stats(status, "free")["rejected"]["queue_full"] >= 12


async def test_bc03_queued_request_whose_client_leaves_is_removed_and_never_dispatched(overload, http):
    await settle(overload)
    saturation = Saturation(http, overload.base_url)
    saturation.add("standard", max_tokens=200, count=2)
    await wait_status(overload, lambda s: tier_stats(s, "standard")["in_flight"] == 2)
    before = tier_stats(overload.status(), "standard")
    queued = asyncio.create_task(post(http, overload.base_url, _chat("Say hello.", max_tokens=8),
                                      headers=_tier("standard")))
    await wait_status(overload, lambda s: tier_stats(s, "standard")["queue_depth"] == 1)
    await asyncio.sleep(0.2)
    queued.cancel()  # tcp close while it waits in the admission queue
    left_s = time.monotonic()
    status = await wait_status(overload, lambda s: tier_stats(s, "standard")["queue_depth"] == 0, 2.0)
    assert time.monotonic() - left_s < 0.5
    assert tier_stats(status, "standard")["cancelled"] == before["cancelled"] + 1
    await saturation.release()
    await asyncio.sleep(0.5)
    after = tier_stats(overload.status(), "standard")
    assert after["admitted"] == before["admitted"]  # only the saturation requests were ever dispatched
    await settle(overload)


async def test_bc26_queue_timeout_sheds_at_the_deadline_and_early_rejection_at_arrival(overload, http):
    await settle(overload)
    before = tier_stats(overload.status(), "batch")
    saturation = Saturation(http, overload.base_url)
    saturation.add("standard", max_tokens=8)  # one sequence slot for well under a second ...
    saturation.add("standard", max_tokens=200)  # ... the other for much longer
    try:
        await wait_status(overload, lambda s: tier_stats(s, "standard")["in_flight"] == 2)
        # a batch request that should start when the first slot frees, within its 1.5 s deadline, queues ...
        waiting = asyncio.create_task(post(http, overload.base_url, _chat(max_tokens=100), headers=_tier("batch")))
        await wait_status(overload, lambda s: tier_stats(s, "batch")["queue_depth"] == 1)
        # ... then two long standard answers arrive and take the slots first (higher priority): it waits past its
        # deadline and is shed there
        saturation.add("standard", max_tokens=200, count=2)
        await wait_status(overload, lambda s: tier_stats(s, "standard")["queue_depth"]
                          + tier_stats(s, "standard")["in_flight"] >= 3
                          and s["workers"][0]["capacity"]["decode_tokens_per_s"] > 0)
        # now a batch request could start only when a 200-token answer ends, far past its deadline, although
        # little work is queued: rejected at arrival (the prediction needs the worker's measured decode rate)
        early = await post(http, overload.base_url, _chat(max_tokens=4), headers=_tier("batch"))
        assert early.status == 503 and early.error_code == "predicted_queue_timeout", early.body
        assert early.elapsed_s < 0.5 and early.retry_after_s >= 1
        assert early.reject_reason == "predicted_queue_timeout"
        timed_out = await waiting
        assert timed_out.status == 503 and timed_out.error_code == "queue_timeout", timed_out.body
        assert 1.5 <= timed_out.elapsed_s <= 2.5  # shed at the configured timeout, not later and not never
        assert timed_out.retry_after_s >= 1 and timed_out.reject_reason == "queue_timeout"
    finally:
        await saturation.release()
    after = tier_stats(overload.status(), "batch")
    assert after["admitted"] == before["admitted"]
    assert after["rejected"].get("queue_timeout", 0) == before["rejected"].get("queue_timeout", 0) + 1


async def test_reserved_share_keeps_room_for_the_top_tier(overload, http):
    await settle(overload)
    saturation = Saturation(http, overload.base_url)
    saturation.add("standard", max_tokens=100, content=LONG_PROMPT)  # (818 + 100) / 16 → 58 blocks of 128
    try:
        await wait_status(overload, lambda s: tier_stats(s, "standard")["in_flight"] == 1)
        # 116 blocks would eat into vip's unused 64: held back (and predicted to start within its deadline, when
        # the first one's 100 tokens are out: queued, not rejected)
        saturation.add("standard", max_tokens=100, content=LONG_PROMPT)
        status = await wait_status(overload, lambda s: tier_stats(s, "standard")["queue_depth"] == 1)
        await asyncio.sleep(0.3)
        status = overload.status()
        assert tier_stats(status, "standard")["queue_depth"] == 1 and tier_stats(status, "standard")["in_flight"] == 1
        assert status["workers"][0]["reservations"] == 1  # a sequence slot is free, yet standard may not take it
        vip = await post(http, overload.base_url, _chat(max_tokens=4), headers=_tier("vip"))
        assert vip.status == 200 and float(vip.headers["x-sluice-queue-ms"]) < 300
        assert vip.elapsed_s < 10 * STEP_S + 1.0
    finally:
        await saturation.release()


async def test_a_prompt_past_its_tiers_share_of_the_kv_pool_is_400_context_length_exceeded_not_a_wait(overload, http):
    # 128 blocks of 16 tokens; vip keeps half of them, so a standard request can never hold more than 64 blocks
    async with http.get(overload.base_url + "/v1/models") as response:
        assert (await response.json())["data"][0]["max_model_len"] == 2048  # the whole pool: vip's limit
    long_prompt = [198] * 1100  # 1,100 tokens: fits the pool, never the standard tier's 1,024
    refused = await post(http, overload.base_url, {"model": MODEL, "prompt": long_prompt, "max_tokens": 4},
                         COMPLETIONS)
    assert refused.status == 400 and refused.error_code == "context_length_exceeded", refused.body
    assert "1024 tokens" in refused.json()["error"]["message"] and refused.json()["error"]["param"] == "prompt"
    assert "retry-after" not in refused.headers
    served = await post(http, overload.base_url, {"model": MODEL, "prompt": long_prompt, "max_tokens": 4},
                        COMPLETIONS, headers=_tier("vip"))
    assert served.status == 200 and served.json()["usage"]["prompt_tokens"] == 1100
    # a prompt that fits gets its output capped to what is left of the share, and is served
    capped = await post(http, overload.base_url, {"model": MODEL, "prompt": [198] * 1000, "max_tokens": 200,
                                                  "ignore_eos": True}, COMPLETIONS)
    assert capped.status == 200 and capped.json()["usage"]["completion_tokens"] == 24, capped.body
    await settle(overload)


async def test_bc28_top_tier_starts_within_one_step_of_capacity_freeing(overload, http):
    await settle(overload)
    body = _chat("Write the numbers from 1 to 5000.")
    # two standard answers fill both slots; the first ends about 2.4 s after it starts (24 steps), so the vip
    # request arrives while every slot is taken however slowly the queue fills on a busy machine, and the free
    # requests queued meanwhile age by less than the vip's lead in that time (aging 0.5 / s, priorities 3 and 1)
    low = [asyncio.create_task(stream_times(http, overload.base_url, {**body, "max_tokens": m, "ignore_eos": True},
                                            _tier("standard"))) for m in (24, 40)]
    await wait_status(overload, lambda s: tier_stats(s, "standard")["in_flight"] == 2)
    queued_low = [asyncio.create_task(stream_times(http, overload.base_url, {**body, "max_tokens": 12},
                                                   _tier("free"))) for _ in range(2)]
    await wait_status(overload, lambda s: tier_stats(s, "free")["queue_depth"] == 2)
    await asyncio.sleep(0.3)
    high = await stream_times(http, overload.base_url, _chat("Explain TCP.", max_tokens=5), _tier("vip"))
    lows = await asyncio.gather(*low)
    queued = await asyncio.gather(*queued_low)
    assert high["status"] == 200 and all(r["status"] == 200 for r in lows + queued)
    capacity_freed_s = min(r["done_s"] for r in lows)
    # the vip request jumps the two queued free requests and starts within about one worker step
    assert high["first_token_s"] - capacity_freed_s <= 2 * STEP_S + 0.3, (high, lows)
    assert all(high["first_token_s"] < r["first_token_s"] for r in queued)
    # it did wait for capacity: none was free when it arrived, it was queued, and it started once some freed
    assert high["sent_s"] < capacity_freed_s < high["first_token_s"], (high, lows)
    assert float(high["queue_ms"]) > 0


SLOTS_CONFIG = """
[model]
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 1024
drain_timeout_s = 5.0

[worker]
backend = "sim"
max_num_seqs = 4
capacity_interval_s = 0.1

[sim]
time_scale = 10.0
kv_cache_gib = 0.25
max_model_len_tokens = 2048

[[tiers]]
name = "vip"
priority = 3
queue_timeout_s = 20.0
reserved_slot_fraction = 0.25   # 1 of the 4 sequence slots

[[tiers]]
name = "standard"
priority = 2
queue_timeout_s = 30.0

[[tiers]]
name = "free"
priority = 1
queue_timeout_s = 60.0

[[api_keys]]
key = "sk-vip"
tenant = "vip-customer"
tier = "vip"
"""


async def test_bc28_a_reserved_slot_lets_a_top_tier_request_start_while_lower_tiers_fill_the_rest(tmp_path, http):
    gateway = _start_gateway(tmp_path, SLOTS_CONFIG)
    saturation = Saturation(http, gateway.base_url)
    try:
        _wait_ready(gateway)
        saturation.add("free", max_tokens=300, count=4)  # long answers for every slot ...
        # ... but the fourth waits: its slot is vip's, idle or not
        await wait_status(gateway, lambda s: tier_stats(s, "free")["in_flight"] == 3
                          and tier_stats(s, "free")["queue_depth"] == 1)
        vip = await post(http, gateway.base_url, _chat(max_tokens=4), headers=_tier("vip"))
        assert vip.status == 200, vip.body
        assert float(vip.headers["x-sluice-queue-ms"]) < 100  # it did not wait for a free answer to end
        assert tier_stats(gateway.status(), "free")["queue_depth"] == 1
    finally:
        await saturation.release()
        _stop_gateway(gateway)



WORKER_DEADLINE_CONFIG = """
[model]
max_model_len_tokens = 2048

[gateway]
max_tokens_cap = 64
drain_timeout_s = 5.0

[worker]
backend = "sim"
max_num_seqs = 8
max_num_batched_tokens = 256   # an 818-token prompt takes 4 steps of about 0.14 s
capacity_interval_s = 0.1

[sim]
time_scale = 10.0
kv_cache_gib = 1.0
max_model_len_tokens = 2048

[admission]
worker_prefill_queue_s = 0.0    # no prefill backlog limit: every request goes to the worker at once

[[tiers]]
name = "vip"
priority = 3
queue_timeout_s = 20.0

[[tiers]]
name = "standard"
priority = 2
queue_timeout_s = 20.0

[[tiers]]
name = "free"
priority = 1
queue_timeout_s = 0.5

[[api_keys]]
key = "sk-vip"
tenant = "vip-customer"
tier = "vip"
"""


async def test_bc26_a_request_overtaken_on_the_worker_is_dropped_unstarted_at_its_deadline_with_503(tmp_path, http):
    # three vip prompts hold the worker's prefill for about 1.7 s; a free request sent to the worker behind them is
    # overtaken there (the worker prefills higher tiers first), so the worker drops it unstarted once its 0.5 s
    # deadline has passed, and the client gets the queue timeout the gateway queue would have given, not a late answer
    gateway = _start_gateway(tmp_path, WORKER_DEADLINE_CONFIG)
    try:
        _wait_ready(gateway)
        vips = [asyncio.create_task(post(http, gateway.base_url, _chat(f"Text {i}. {LONG_PROMPT}", max_tokens=4),
                                         headers=_tier("vip"))) for i in range(3)]  # no shared prefix
        await wait_status(gateway, lambda s: tier_stats(s, "vip")["in_flight"] == 3)
        free = await post(http, gateway.base_url, _chat("Say hi.", max_tokens=4), headers=_tier("free"))
        assert free.status == 503, free.body
        error = json.loads(free.body)["error"]
        assert error["code"] == "queue_timeout" and "not started by its deadline" in error["message"], error
        assert int(free.headers["retry-after"]) >= 1
        assert all(reply.status == 200 for reply in await asyncio.gather(*vips))
        status = await settle(gateway)
        assert tier_stats(status, "free")["rejected"] == {"queue_timeout": 1}
        assert tier_stats(status, "free")["in_flight"] == 0
        # a free request on an idle worker starts at once and is served
        again = await post(http, gateway.base_url, _chat("Say hi.", max_tokens=4), headers=_tier("free"))
        assert again.status == 200, again.body
    finally:
        _stop_gateway(gateway)

async def test_bc28_a_lower_tier_is_not_starved_by_a_top_tier_flood(overload, http):
    await settle(overload)
    stop = asyncio.Event()

    async def flood() -> int:
        served = 0
        while not stop.is_set():
            reply = await post(http, overload.base_url, _chat("Count to 20.", max_tokens=4), headers=_tier("vip"))
            served += reply.status == 200
        return served

    flooders = [asyncio.create_task(flood()) for _ in range(4)]
    try:
        await wait_status(overload, lambda s: tier_stats(s, "vip")["queue_depth"] >= 1)
        starved = await asyncio.wait_for(
            post(http, overload.base_url, _chat("Say hi.", max_tokens=4), headers=_tier("standard")), 10.0)
    finally:
        stop.set()
        served = await asyncio.gather(*flooders)
    assert starved.status == 200, starved.body
    # it waited behind the flood, then aging (0.5 priority points per s) let it pass the fresh vip requests
    assert float(starved.headers["x-sluice-queue-ms"]) > 500
    assert starved.elapsed_s < 8.0 and sum(served) >= 4


async def test_bc20_pressure_levels_tighten_each_tiers_cap_and_relax_again(overload, http):
    status = await settle(overload)
    transitions = status["pressure"]["num_transitions"]
    normal, free = await asyncio.gather(
        post(http, overload.base_url, _chat(max_tokens=12), headers=_tier("vip")),
        post(http, overload.base_url, _chat(max_tokens=10_000), headers=_tier("free")))
    assert normal.json()["usage"]["completion_tokens"] == 12
    assert free.json()["usage"]["completion_tokens"] == 12 and free.json()["choices"][0]["finish_reason"] == "length"
    saturation = Saturation(http, overload.base_url)
    saturation.add("standard", max_tokens=100, content=LONG_PROMPT)  # 58 of the 128 KV blocks
    try:
        # decoding, with a measured rate: the next one's predicted wait counts until this one ends
        await wait_status(overload, lambda s: tier_stats(s, "standard")["in_flight"] == 1
                          and s["workers"][0]["capacity"]["sequence_decode_tokens_per_s"] > 0)
        # queued (vip's KV share) until the first one's 100 tokens are out: seconds of predicted wait, past the
        # 2 s at which pressure turns elevated
        saturation.add("standard", max_tokens=100, content=LONG_PROMPT)
        await wait_status(overload, lambda s: s["pressure"]["level"] == "elevated")
        async with http.get(overload.base_url + "/metrics") as response:
            assert metric_value(await response.text(), "sluice_pressure_level") == 1.0
        bodies = [_chat(max_tokens=12), _chat(), _chat(max_completion_tokens=10_000),
                  _chat(max_tokens=12, stream=True, stream_options={"include_usage": True})]
        replies = [await post(http, overload.base_url, body, headers=_tier("vip")) for body in bodies]
        for reply in replies[:3]:
            assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 6  # elevated vip cap
            assert reply.json()["choices"][0]["finish_reason"] == "length"
        usage = [json.loads(e) for e in replies[3].events() if e != b"[DONE]" and b'"usage"' in e]
        assert usage[-1]["usage"]["completion_tokens"] == 6
    finally:
        await saturation.release()
    status = await settle(overload)  # hysteresis: back to normal once the queue is gone and the dwell has passed
    assert status["pressure"]["num_transitions"] >= transitions + 2
    relaxed = await post(http, overload.base_url, _chat(max_tokens=12), headers=_tier("vip"))
    assert relaxed.json()["usage"]["completion_tokens"] == 12


async def test_n2_choices_are_admitted_as_two_tickets_of_the_request(overload, http):
    await settle(overload)
    before = tier_stats(overload.status(), "standard")["admitted"]
    reply = await post(http, overload.base_url, _chat(max_tokens=3, n=2))
    assert reply.status == 200 and [c["index"] for c in reply.json()["choices"]] == [0, 1]
    assert tier_stats(overload.status(), "standard")["admitted"] == before + 2


async def test_choices_that_outnumber_the_pools_sequence_slots_are_a_400_at_once_not_a_stuck_queue(overload, http):
    """README trial 7: a request's choices are admitted together, so one with more choices than the pool has slots
    held the slots it got, blocked everyone behind it and ended in a 503 after its queue deadline (15 s), which no
    retry could change. The pool here runs 2 sequences at once."""
    await settle(overload)
    started_s = time.monotonic()
    too_many = await post(http, overload.base_url, _chat(max_tokens=3, n=3))
    assert too_many.status == 400 and too_many.json()["error"]["param"] == "n", too_many.body
    assert "needs 3 sequences at once" in too_many.json()["error"]["message"]
    prompts = await post(http, overload.base_url, {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2},
                         path=COMPLETIONS)
    assert prompts.status == 400 and prompts.json()["error"]["param"] == "prompt", prompts.body
    assert time.monotonic() - started_s < 5.0  # refused at once, not after the queue deadline
    fits = await post(http, overload.base_url, {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2},
                      path=COMPLETIONS)
    assert fits.status == 200 and len(fits.json()["choices"]) == 2, fits.body


async def test_sigterm_drains_running_requests_rejects_new_ones_then_exits(overload, http):
    await settle(overload)
    worker_pids = _child_pids(overload.process.pid)
    first_byte = asyncio.Event()
    running = asyncio.create_task(post(http, overload.base_url, _chat(max_tokens=15, stream=True),
                                       on_first_byte=first_byte))
    await asyncio.wait_for(first_byte.wait(), 10)
    overload.process.send_signal(signal.SIGTERM)
    signalled_s = time.monotonic()
    await asyncio.sleep(0.2)
    rejected = await post(http, overload.base_url, _chat(max_tokens=4))
    assert rejected.status == 503 and rejected.error_code == "server_draining" and rejected.retry_after_s >= 1
    assert rejected.reject_reason == "server_draining"
    assert get_json(overload.base_url + "/readyz")[0] == 503
    done = await running
    events = done.events()
    assert done.status == 200 and events[-1] == b"[DONE]" and b'"finish_reason":"length"' in b"".join(events)
    returncode = await asyncio.to_thread(overload.process.wait, 30)
    assert returncode == 0 and time.monotonic() - signalled_s < 10.0
    # the local worker was stopped too, and the fork server and multiprocessing's helpers follow the gateway out
    # (they see its pipes close: on a loaded machine that can take more than a moment)
    deadline_s = time.monotonic() + HELPER_EXIT_TIMEOUT_S
    while any(_alive(pid) for pid in worker_pids) and time.monotonic() < deadline_s:
        await asyncio.sleep(0.1)
    assert worker_pids and not [pid for pid in worker_pids if _alive(pid)]


async def test_requests_still_running_when_the_drain_times_out_end_with_server_draining_not_a_cut(tmp_path, http):
    """README trial 5: a stream still running at ``drain_timeout_s`` stopped mid-answer with no error and no
    ``[DONE]`` (the SDK saw a connection error) and was logged as a client disconnect."""
    gateway = _start_gateway(tmp_path, OVERLOAD_CONFIG.replace("drain_timeout_s = 10.0", "drain_timeout_s = 1.0"))
    try:
        _wait_ready(gateway)
        first_byte = asyncio.Event()
        streamed = asyncio.create_task(post(http, gateway.base_url, _chat(max_tokens=400, stream=True),
                                            on_first_byte=first_byte))  # about 40 s of tokens
        whole = asyncio.create_task(post(http, gateway.base_url, _chat(max_tokens=400)))
        await asyncio.wait_for(first_byte.wait(), 10)
        await wait_status(gateway, lambda s: tier_stats(s, "standard")["in_flight"] == 2)
        gateway.process.send_signal(signal.SIGTERM)
        streamed, whole = await asyncio.gather(streamed, whole)
        events = streamed.events()
        assert streamed.status == 200 and events[-1] == b"[DONE]", streamed.body[-400:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_draining" and "drain_timeout_s" in error["message"], error
        assert whole.status == 503 and whole.error_code == "server_draining", whole.body
        assert await asyncio.to_thread(gateway.process.wait, 30) == 0
        lines = [json.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith("{")]
        outcomes = [line.get("outcome") for line in lines if line.get("event") == "request" and line.get("tier")]
        assert "client_disconnected" not in outcomes and "error_in_band" in outcomes, outcomes
    finally:
        _stop_gateway(gateway)


async def test_sigterm_lets_running_jobs_finish_within_the_drain_and_requeues_the_rest_unspent(tmp_path, http):
    """README trial 6: the drain waited for HTTP requests only, so SIGTERM put a running job back in its queue at
    once and threw its work away. A job that finishes within ``drain_timeout_s`` now succeeds; one still running
    then goes back to the queue without using an attempt."""
    from gateway.jobs.models import QUEUED, SUCCEEDED
    from gateway.jobs.sqlite_store import SqliteJobStore

    jobs_path = tmp_path / "jobs.sqlite3"
    config = OVERLOAD_CONFIG.replace("drain_timeout_s = 10.0", "drain_timeout_s = 4.0") + f"""
[jobs]
sqlite_path = "{jobs_path}"
poll_interval_s = 0.05
idle_grace_s = 0.0
"""
    gateway = _start_gateway(tmp_path, config)
    try:
        _wait_ready(gateway)
        ids = []
        for max_tokens in (12, 400):  # about 1.2 s and 40 s of tokens
            reply = await post(http, gateway.base_url, _chat(max_tokens=max_tokens, ignore_eos=True), path="/v1/jobs")
            assert reply.status == 202, reply.body
            ids.append(reply.json()["id"])
        await wait_status(gateway, lambda s: tier_stats(s, "batch")["in_flight"] == 2)
        gateway.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gateway.process.wait, 30) == 0
    finally:
        _stop_gateway(gateway)
    store = SqliteJobStore(jobs_path)
    await store.open()
    try:
        short, long = [await store.get_job(job_id) for job_id in ids]
    finally:
        await store.close()
    assert short.status == SUCCEEDED, short
    assert msgspec.json.decode(short.result)["usage"]["completion_tokens"] == 12
    assert long.status == QUEUED and long.attempts == 0, long


@pytest.mark.parametrize("start_method", ["forkserver", "exec"])
async def test_a_signal_to_the_gateway_process_group_drains_before_the_workers_stop(tmp_path, http, start_method):
    """Ctrl-C in a terminal, or ``kill -TERM -- -<pgid>``, signals the gateway's whole process group: its local
    workers are in groups of their own, so the gateway drains and the stream in flight ends whole (README trial 4:
    the worker stopped at once and the stream got 502 ``worker_failed``)."""
    config = OVERLOAD_CONFIG.replace("drain_timeout_s = 10.0",
                                     f'drain_timeout_s = 10.0\nworker_start_method = "{start_method}"')
    gateway = _start_gateway(tmp_path, config)
    try:
        _wait_ready(gateway)
        first_byte = asyncio.Event()
        running = asyncio.create_task(post(http, gateway.base_url, _chat(max_tokens=15, stream=True),
                                           on_first_byte=first_byte))
        await asyncio.wait_for(first_byte.wait(), 10)
        os.killpg(os.getpgid(gateway.process.pid), signal.SIGTERM)
        done = await running
        events = done.events()
        assert done.status == 200 and events[-1] == b"[DONE]", done.body[-300:]
        assert b'"finish_reason":"length"' in b"".join(events)
        assert await asyncio.to_thread(gateway.process.wait, 30) == 0
    finally:
        _stop_gateway(gateway)


# ---------------------------------------------------------------------------------------------- worker health


@pytest.fixture(scope="module")
def health(tmp_path_factory, tokenizer):
    """A gateway over: fake A (silent, biggest KV), fake B (silent), a real sim worker, and a dead address."""
    workdir = tmp_path_factory.mktemp("health")
    sim = SluiceProcess(HEALTH_CONFIG, workdir / "sim", command="worker", args=["--worker-id", "sim-0"],
                        ready="none").start()
    sim_port, dead_port = sim.port, free_port()
    token_id = tokenizer.encode_text_sync(" hello")[0]
    fakes = FakeWorkers([FakeWorker("fake-a", 3_000_000, token_id=token_id),
                         FakeWorker("fake-b", 2_000_000, token_id=token_id)])
    with fakes:
        addresses = [f"127.0.0.1:{w.port}" for w in fakes.workers] + [f"127.0.0.1:{sim_port}",
                                                                       f"127.0.0.1:{dead_port}"]
        gateway = _start_gateway(workdir, HEALTH_CONFIG, addresses)
        try:
            _wait_ready(gateway)
            deadline = time.monotonic() + 120
            while sum(w["ready"] for w in gateway.status()["workers"]) < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
            yield gateway, fakes, sim.process
        finally:
            gateway.stop()
            sim.stop()


async def _eventually(condition, what: str, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds: the fake workers read their frames on a thread of their own, so a frame
    the gateway sent as it answered may still be in flight when the answer arrives here."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.02)


def _workers_by_name(status: dict) -> dict[str, dict]:
    return {w["name"]: w for w in status["workers"]}


async def test_first_token_timeout_breaker_open_half_open_close(health, http):
    gateway, fakes, _ = health
    fake_a, fake_b = fakes.workers
    workers = _workers_by_name(gateway.status())
    assert workers["remote-3"]["ready"] is False  # nothing listens there: never routed to
    assert [workers[f"remote-{i}"]["ready"] for i in range(3)] == [True, True, True]

    # A accepts and stays silent: 504 worker_timeout at the first-token deadline (0.8 s), which bounds the whole
    # choice: no time is left for a retry, on B or anywhere; JSON, not SSE. Two at once, both routed to A (the
    # biggest KV pool), so that A's breaker opens at once (threshold 2)
    plain, streamed = await asyncio.gather(
        post(http, gateway.base_url, {"model": MODEL, "prompt": "one", "max_tokens": 4}, COMPLETIONS),
        post(http, gateway.base_url, {"model": MODEL, "prompt": "two", "max_tokens": 4, "stream": True},
             COMPLETIONS))
    assert plain.status == 504 and plain.error_code == "worker_timeout", plain.body
    assert 0.8 <= plain.elapsed_s < 1.6
    assert streamed.status == 504 and not streamed.body.startswith(b"data:")
    assert len(fake_a.generates) == 2 and len(fake_b.generates) == 0
    await _eventually(lambda: len(fake_a.aborts) == 2, "A's two aborts")  # sent as the 504s are; read on its thread
    # A's breaker is open: B (also silent) takes the next two and opens too
    replies = await asyncio.gather(*(post(http, gateway.base_url, {"model": MODEL, "prompt": prompt, "max_tokens": 4},
                                          COMPLETIONS) for prompt in ("three", "four")))
    assert all(r.status == 504 and r.error_code == "worker_timeout" for r in replies), replies
    assert len(fake_a.generates) == 2 and len(fake_b.generates) == 2
    workers = _workers_by_name(gateway.status())
    assert workers["remote-0"]["breaker"]["state"] == "open" and workers["remote-1"]["breaker"]["state"] == "open"
    async with http.get(gateway.base_url + "/metrics") as response:
        assert metric_value(await response.text(), "sluice_breaker_state", worker="remote-0") == 2.0

    # both breakers open: the sim worker serves at once and the fakes see nothing
    served = await post(http, gateway.base_url, {"model": MODEL, "prompt": "five", "max_tokens": 4}, COMPLETIONS)
    assert served.status == 200 and served.elapsed_s < 0.8
    assert len(fake_a.generates) == 2 and len(fake_b.generates) == 2

    # after the cooldown both are half-open; A's probe times out (open again), the next request probes B, which
    # answers
    fake_b.mode = "ok"
    await asyncio.sleep(1.6)
    assert _workers_by_name(gateway.status())["remote-0"]["breaker"]["state"] == "half_open"
    probe_a = await post(http, gateway.base_url, {"model": MODEL, "prompt": "six", "max_tokens": 4}, COMPLETIONS)
    assert probe_a.status == 504 and len(fake_a.generates) == 3 and len(fake_b.generates) == 2
    probed = await post(http, gateway.base_url, {"model": MODEL, "prompt": "seven", "max_tokens": 4}, COMPLETIONS)
    assert probed.status == 200 and probed.json()["usage"]["completion_tokens"] == 4
    assert len(fake_a.generates) == 3 and len(fake_b.generates) == 3
    workers = _workers_by_name(gateway.status())
    assert workers["remote-0"]["breaker"]["state"] == "open" and workers["remote-0"]["breaker"]["num_opens"] == 2
    assert workers["remote-1"]["breaker"]["state"] == "closed"


async def test_deep_readiness_is_503_naming_the_connected_worker_that_cannot_generate(health, http):
    gateway, fakes, _ = health
    fake_a, fake_b = fakes.workers
    assert fake_a.mode == "silent" and fake_b.mode == "ok"  # A has never sent a token; B and the sim worker do
    async with http.get(gateway.base_url + "/readyz") as response:
        assert response.status == 200  # connected and said Hello: ready for the plain check
    num_probes = len(fake_a.generates)
    for _ in range(2):  # the second answer comes from the cache: A is not probed again
        async with http.get(gateway.base_url + "/readyz?deep=1") as response:
            body = await response.json()
            assert response.status == 503 and body["error"]["code"] == "worker_not_generating", body
            assert response.headers["x-sluice-reject-reason"] == "worker_not_generating"
        message = body["error"]["message"]
        assert "remote-0 generated no token within 0.8 s" in message
        assert "remote-1" not in message and "remote-2" not in message, message
        assert len(fake_a.generates) == num_probes + 1
        await _eventually(lambda: len(fake_a.aborts) >= 1, "the abort of A's probe")


async def test_stall_after_the_first_token_is_an_in_band_error_and_504_without_a_stream(health, http):
    gateway, fakes, _ = health
    for fake in fakes.workers:
        fake.mode = "stall"
    await asyncio.sleep(1.6)  # whatever breaker is open turns half-open; either fake takes the request
    streamed = await post(http, gateway.base_url, _chat(max_tokens=8, stream=True))
    events = streamed.events()
    assert streamed.status == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert any(b"hello" in e for e in events)
    assert json.loads(events[-2])["error"]["code"] == "worker_timeout" and events[-1] == b"[DONE]"
    assert 0.8 <= streamed.elapsed_s < 2.0
    plain = await post(http, gateway.base_url, _chat(max_tokens=8))
    assert plain.status == 504 and plain.error_code == "worker_timeout"  # no byte sent yet: a plain error


async def test_bc26_no_worker_at_all_is_503_no_worker_available(health, http):
    gateway, fakes, sim = health
    fakes.stop_all()
    sim.send_signal(signal.SIGTERM)
    await asyncio.to_thread(sim.wait, 30)
    await wait_status(gateway, lambda s: not any(w["ready"] for w in s["workers"]))
    replies = [await post(http, gateway.base_url, _chat(max_tokens=4)) for _ in range(3)]
    for reply in replies:
        assert reply.status == 503 and reply.error_code == "no_worker_available" and reply.retry_after_s >= 1
        assert reply.reject_reason == "no_worker_available"
    assert get_json(gateway.base_url + "/readyz")[0] == 503
