"""Tier counters shared by gateways through the real Redis at 127.0.0.1:6379 (``make redis``), and several gateways
on one port (issue 7), each test under its own key prefix:

- in process: two :class:`TierCounters` see each other's exact counts; one that closes leaves at once, one that goes
  silent after the TTL; Redis down → local counts only, logged once; the admission hook pins the exact queue-full
  decision with a fake "queued elsewhere" count;
- real processes over loopback: two ``sluice serve --reuse-port`` on one port both answer, each with its own
  ``x-sluice-gateway``; two gateways with sim workers (the roofline SIMULATOR) sharing counters: ``/status``
  ``fleet_tiers`` and ``/metrics`` of one show the other's requests, and a tier's ``queue_capacity`` holds across
  both (one gateway's full queue makes the other answer 503 ``queue_full`` with an idle worker of its own).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from structlog.testing import capture_logs
from redis import asyncio as aioredis

from gateway.admission.controller import AdmissionController
from gateway.admission.tier_counters import TTL_INTERVALS, TierCounters, TierCounts
from shared.config import Config, RateLimitConfig, RegistryConfig
from shared.errors import ErrorCode, SluiceError
from tests.support.server import ProcessExited, SluiceProcess, free_port, wait_for
from tests.gateway.test_admission import FakeClock, FakePool, make_config, prompt, queued_task, settle, tiers

REDIS_URL = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 180.0
MODEL = "SmolLM2-135M-Instruct"
INTERVAL_S = 0.2


@pytest.fixture
def prefix(redis_prefix):
    """A fresh Redis key prefix, cleaned up afterwards (``tests/conftest.py``)."""
    return redis_prefix


def counters(prefix: str, gateway_id: str, local: dict[str, TierCounts], url: str = REDIS_URL,
             clock=time.monotonic) -> TierCounters:
    client = aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    return TierCounters(gateway_id, lambda: dict(local), client, prefix, INTERVAL_S, clock)


# ---------------------------------------------------------------------------------------------- in process


async def test_two_gateways_see_each_others_exact_counts_and_leave_on_close(prefix):
    local_a = {"gold": TierCounts(queued=1, in_flight=2, admitted=10, rejected={"queue_full": 1})}
    local_b = {"gold": TierCounts(queued=3, in_flight=1, admitted=5, rejected={"queue_full": 2, "queue_timeout": 4}),
               "tin": TierCounts(queued=7)}
    a, b = counters(prefix, "gw-a", local_a), counters(prefix, "gw-b", local_b)
    assert await a.sync_once() and await b.sync_once() and await a.sync_once()

    assert a.queued_elsewhere("gold") == 3 and a.queued_elsewhere("tin") == 7 and a.queued_elsewhere("none") == 0
    assert b.queued_elsewhere("gold") == 1 and b.queued_elsewhere("tin") == 0
    snapshot = a.snapshot()
    assert snapshot["shared"] and snapshot["redis_ok"] and snapshot["gateways"] == ["gw-a", "gw-b"]
    assert snapshot["tiers"]["gold"] == {"queued": 4, "in_flight": 3, "admitted": 15,
                                         "rejected": {"queue_full": 3, "queue_timeout": 4}, "num_gateways": 2}
    assert snapshot["tiers"]["tin"] == {"queued": 7, "in_flight": 0, "admitted": 0, "rejected": {},
                                        "num_gateways": 1}
    local_a["gold"] = TierCounts(queued=2)  # this gateway's own counts are read fresh, the others' at each sync
    assert a.snapshot()["tiers"]["gold"]["queued"] == 5

    client = aioredis.Redis.from_url(REDIS_URL)
    ttl_ms = await client.pttl(f"{prefix}:gw-b")
    assert 0 < ttl_ms <= TTL_INTERVALS * INTERVAL_S * 1000
    await b.close()  # a clean shutdown removes its counts at once
    assert await client.exists(f"{prefix}:gw-b") == 0
    assert await a.sync_once()
    assert a.queued_elsewhere("gold") == 0 and a.snapshot()["gateways"] == ["gw-a"]
    await a.close()
    assert [key async for key in client.scan_iter(match=prefix + "*")] == []  # nothing left behind
    await client.aclose()


async def test_a_silent_gateway_drops_out_after_the_ttl(prefix):
    a = counters(prefix, "gw-a", {"gold": TierCounts()})
    silent = counters(prefix, "gw-silent", {"gold": TierCounts(queued=2)})
    assert await silent.sync_once() and await a.sync_once()
    assert a.queued_elsewhere("gold") == 2
    await asyncio.sleep(TTL_INTERVALS * INTERVAL_S + 0.1)  # killed: never publishes again, never removes itself
    assert await a.sync_once()
    assert a.queued_elsewhere("gold") == 0 and a.snapshot()["gateways"] == ["gw-a"]
    await a.close()
    await silent._client.aclose()


async def test_counts_older_than_the_ttl_are_not_used_when_syncs_stop(prefix):
    clock = FakeClock()
    a = counters(prefix, "gw-a", {"gold": TierCounts()}, clock=clock)
    b = counters(prefix, "gw-b", {"gold": TierCounts(queued=2)})
    assert await b.sync_once() and await a.sync_once()
    assert a.queued_elsewhere("gold") == 2
    clock.advance(TTL_INTERVALS * INTERVAL_S)  # this gateway's own syncs stalled that long
    assert a.queued_elsewhere("gold") == 0 and a.snapshot()["tiers"]["gold"]["num_gateways"] == 1
    await a.close()
    await b.close()


async def test_redis_down_counts_locally_and_logs_once(prefix):
    port = free_port()  # nothing listens there
    down = counters(prefix, "gw-a", {"gold": TierCounts(queued=1)}, url=f"redis://127.0.0.1:{port}/0")
    with capture_logs() as logs:
        results = [await down.sync_once() for _ in range(3)]
    assert results == [False, False, False] and down.num_redis_errors == 3
    assert [entry["event"] for entry in logs] == ["tier_counters_redis_failed_counting_locally"]
    assert down.queued_elsewhere("gold") == 0
    snapshot = down.snapshot()
    assert snapshot["shared"] and not snapshot["redis_ok"]
    assert snapshot["tiers"]["gold"]["queued"] == 1 and snapshot["gateways"] == ["gw-a"]
    await down.close()  # removing its counts fails quietly


def test_from_config_shares_only_with_a_redis_url():
    def make(**ratelimit) -> TierCounters:
        registry = RegistryConfig(redis_url=ratelimit.pop("registry_url", ""))
        config = Config(ratelimit=RateLimitConfig(**ratelimit), registry=registry)
        return TierCounters.from_config(config, "gw", dict)

    assert not make().shared
    assert make(registry_url=REDIS_URL).shared  # like the redis rate limiter: its own URL, else the registry's
    assert make(redis_url=REDIS_URL).shared
    assert not make(redis_url=REDIS_URL, share_tier_counters=False).shared


async def test_queue_capacity_counts_requests_queued_on_other_gateways():
    pool = FakePool(max_num_seqs=1)
    controller = AdmissionController(make_config(tiers(free=dict(queue_capacity=3))), pool, clock=FakeClock())
    assert controller.queued_elsewhere("free") == 0  # the default: this gateway alone
    elsewhere = {"free": 1}
    controller.queued_elsewhere = lambda tier: elsewhere.get(tier, 0)
    await controller.admit(controller.make_ticket("free", prompt(8), 8))  # running: the worker is full now
    waiting = [queued_task(controller, controller.make_ticket("free", prompt(8), 8)) for _ in range(2)]
    await settle()
    assert not any(task.done() for task in waiting)  # 2 here + 1 elsewhere = 3 = capacity
    with pytest.raises(SluiceError) as info:
        await controller.admit(controller.make_ticket("free", prompt(8), 8))
    assert info.value.code is ErrorCode.QUEUE_FULL and info.value.retry_after_s >= 1
    other = queued_task(controller, controller.make_ticket("standard", prompt(8), 8))  # other tiers: own counts
    elsewhere["free"] = 0  # the other gateway's queue drained
    third = queued_task(controller, controller.make_ticket("free", prompt(8), 8))
    await settle()
    assert not other.done() and not third.done()
    assert controller.snapshot()["tiers"]["free"]["rejected"] == {"queue_full": 1}
    for task in [*waiting, other, third]:
        task.cancel()
    await asyncio.gather(*waiting, other, third, return_exceptions=True)


# ---------------------------------------------------------------------------------------------- real processes


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """GET over a new connection (urllib opens one per request)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


class Gateway(SluiceProcess):
    """A ``sluice serve`` process with its own config and log, on ``port``; :meth:`start` does not wait."""

    def __init__(self, config_text: str, port: int, *extra_args: str) -> None:
        super().__init__(config_text, port=port, args=extra_args, ready="none", start_timeout_s=START_TIMEOUT_S)

    @property
    def gateway_id(self) -> str:
        return f"{socket.gethostname()}-{self.process.pid}"  # the default id: this process's

    def wait_listening(self) -> None:
        wait_for(lambda: self._alive() and '"gateway_listening"' in self.log_text(), START_TIMEOUT_S,
                 "gateway_listening")

    def _alive(self) -> bool:
        try:
            return self.check_alive()
        except ProcessExited as exc:
            raise AssertionError(str(exc)) from None

    def stop(self) -> None:
        super().stop(timeout_s=60)
        self.close()

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def test_two_gateways_with_reuse_port_share_one_port_and_both_answer():
    port = free_port()
    config = """
[gateway]
drain_timeout_s = 1.0

[[pools]]
name = "remote"
min_workers = 0
max_workers = 0
"""
    first = Gateway(config, port, "--reuse-port").start()
    second = Gateway(config.replace("[gateway]", "[gateway]\nreuse_port = true"), port).start()  # the config key
    try:
        first.wait_listening()
        second.wait_listening()
        seen: set[str] = set()
        for _ in range(200):  # a new connection each: the kernel hashes each one to either listener
            code, headers, _ = http_get(f"http://127.0.0.1:{port}/healthz")
            assert code == 200
            seen.add(headers["x-sluice-gateway"])
            if len(seen) == 2:
                break
        assert seen == {first.gateway_id, second.gateway_id}
        code, headers, body = http_get(f"http://127.0.0.1:{port}/nowhere")  # errors carry it too
        assert code == 404 and headers["x-sluice-gateway"] in seen
    finally:
        first.stop()
        second.stop()


SHARED_CONFIG = """
default_tier = "gold"

[gateway]
drain_timeout_s = 1.0

[worker]
num_local_workers = 1
backend = "sim"
max_num_seqs = 1

[sim]
time_scale = 100.0

[admission]
early_rejection = false

[[tiers]]
name = "gold"
priority = 1
queue_capacity = 2
queue_timeout_s = 300.0

[ratelimit]
redis_url = "{redis_url}"
tier_counters_key_prefix = "{prefix}"
tier_counters_interval_s = {interval_s}
"""


async def chat(session: aiohttp.ClientSession, base_url: str, max_tokens: int) -> tuple[int, dict, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    async with session.post(base_url + "/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=300)) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)


async def poll(session: aiohttp.ClientSession, url: str, predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(url) as response:
            body = await response.text()
        value = predicate(json.loads(body) if url.endswith("/status") else body)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {body[:2000]}")
        await asyncio.sleep(INTERVAL_S)


async def test_two_gateways_share_tier_counts_and_a_fleet_wide_queue_capacity(prefix):
    config = SHARED_CONFIG.format(redis_url=REDIS_URL, prefix=prefix, interval_s=INTERVAL_S)
    a = Gateway(config, free_port()).start()
    b = Gateway(config, free_port()).start()
    tasks: list[asyncio.Task] = []
    try:
        for gw in (a, b):  # both ready: a sim worker each
            gw.wait_listening()
            wait_for(lambda: gw._alive() and http_get(gw.base_url + "/readyz")[0] == 200, START_TIMEOUT_S,
                     "the gateway's sim worker")
        async with aiohttp.ClientSession() as session:
            # One long request runs on b's only slot (≈ 0.7 s per token at time_scale 100).
            tasks.append(asyncio.create_task(chat(session, b.base_url, 200)))

            def b_running(status: dict) -> bool:
                gold = status["fleet_tiers"]["tiers"]["gold"]
                return gold["in_flight"] == 1 and gold["admitted"] >= 1 and gold["num_gateways"] == 2

            status = await poll(session, a.base_url + "/status", lambda s: s if b_running(s) else None, 30.0,
                                "b's running request in a's fleet_tiers")
            assert status["gateway_id"] == a.gateway_id
            assert status["fleet_tiers"]["gateways"] == sorted([a.gateway_id, b.gateway_id])
            assert status["admission"]["tiers"]["gold"]["in_flight"] == 0  # a's own counts: nothing
            await poll(session, a.base_url + "/metrics",
                       lambda text: 'sluice_fleet_tier_in_flight{tier="gold"} 1.0' in text
                       and "sluice_fleet_gateways 2.0" in text, 30.0, "the fleet gauges on a's /metrics")

            # Two more wait in b's gold queue: full (queue_capacity 2) across both gateways.
            tasks += [asyncio.create_task(chat(session, b.base_url, 1)) for _ in range(2)]
            await poll(session, a.base_url + "/status",
                       lambda s: s["fleet_tiers"]["tiers"]["gold"]["queued"] == 2, 30.0, "b's queue in a's counts")
            await poll(session, a.base_url + "/metrics",
                       lambda text: 'sluice_fleet_tier_queued{tier="gold"} 2.0' in text, 30.0,
                       "sluice_fleet_tier_queued on a")
            code, headers, body = await chat(session, a.base_url, 1)  # a's own worker is idle
            assert code == 503 and body["error"]["code"] == ErrorCode.QUEUE_FULL.value, (code, body)
            assert int(headers["Retry-After"]) >= 1 and headers["x-sluice-gateway"] == a.gateway_id
            await poll(session, b.base_url + "/status",  # and b sees a's rejection
                       lambda s: s["fleet_tiers"]["tiers"]["gold"]["rejected"].get("queue_full") == 1, 30.0,
                       "a's queue_full rejection in b's fleet_tiers")

            # b's queue empties (its clients leave): a takes gold requests again.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await poll(session, a.base_url + "/status",
                       lambda s: s["fleet_tiers"]["tiers"]["gold"]["queued"] == 0, 30.0, "b's queue drained")
            code, _, body = await chat(session, a.base_url, 1)
            assert code == 200, (code, body)
    finally:
        for task in tasks:
            task.cancel()
        a.stop()
        b.stop()
    client = aioredis.Redis.from_url(REDIS_URL)
    assert [key async for key in client.scan_iter(match=prefix + "*")] == []  # both removed their counts on exit
    await client.aclose()
