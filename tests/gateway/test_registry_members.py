"""A gateway's registry workers through a Redis that comes back empty (README trial 15): real ``sluice serve`` and
``sluice worker --registry`` processes and the real Redis at 127.0.0.1:6379 (``make redis``).

A Redis restarted without persistence, or flushed, holds no worker entry until each worker's next heartbeat writes
its own again. The gateway read the empty index as every worker deregistering, closed their connections and failed
the requests they ran ("worker … failed: gateway shutting down"); a worker that leaves the registry now keeps the
requests it runs, and one that comes back under the same incarnation keeps its connection."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import msgspec
import redis

from gateway.fleet.fleet import Fleet
from gateway.metrics import Metrics
from shared.config import Config
from tests.gateway.test_fleet import REDIS_URL, SIM_TIME_SCALE, START_TIMEOUT_S, Gateway, Worker, chat, \
    remote_pool_config
from tests.support.server import wait_for

OUTPUT_TOKENS = 60  # about 4 s of decode at SIM_TIME_SCALE: the stream spans the registry's empty spell


def test_a_registry_that_comes_back_empty_cuts_no_request_and_keeps_the_workers_connection(redis_prefix):
    config = remote_pool_config(redis_prefix, poll_interval_s=0.1)
    # the worker writes its entry every 1.5 s, the gateway scans every 0.1 s: it sees the registry empty
    with Gateway(config) as gw, Worker(redis_prefix, "w", time_scale=SIM_TIME_SCALE, heartbeat_interval_s=1.5):
        wait_for(lambda: gw.pool("remote")["workers"]["ready"] == 1, START_TIMEOUT_S, "the worker to register")
        assert gw.status()["fleet"]["registry"] == {"reachable": True, "errors": 0, "known_workers": 1}

        async def scenario():
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(chat(session, gw.base_url, "a long answer", OUTPUT_TOKENS, stream=True))
                await asyncio.to_thread(wait_for, lambda: gw.status()["workers"][0]["in_flight"] == 1, 30.0,
                                        "the request on the worker")
                client = redis.Redis.from_url(REDIS_URL)
                try:  # what Redis holds after a restart without persistence: none of the registry's keys
                    client.delete(*client.scan_iter(match=redis_prefix + "*"))
                finally:
                    client.close()
                await asyncio.to_thread(wait_for, lambda: gw.log_events("registry_worker_back"), 10.0,
                                        "the worker's next heartbeat to bring it back")
                streamed = await task
                after = await chat(session, gw.base_url, "after the gap", 4)
                return streamed, after

        (code, _, streamed), after = asyncio.run(scenario())
        assert code == 200 and streamed["error"] is None, (streamed, gw.log_tail())
        assert streamed["usage"]["completion_tokens"] == OUTPUT_TOKENS
        assert [event["reason"] for event in gw.log_events("registry_leave")] == ["deregistered"]
        assert after[0] == 200
        worker = gw.status()["workers"][0]
        assert worker["ready"] and worker["connections"] == 1  # the connection it had, never closed
        assert not gw.log_events("worker_disconnected")
        metrics = urllib.request.urlopen(gw.base_url + "/metrics", timeout=10).read().decode()
        assert "sluice_registry_reachable 1.0" in metrics and "sluice_registry_errors_total 0.0" in metrics


def test_before_any_worker_registers_the_pools_say_so_not_that_none_is_configured():
    """README trial 15: ``/readyz`` answered "no worker configured" until the first registry scan found workers."""
    config = msgspec.convert({"registry": {"redis_url": REDIS_URL},
                              "pools": [{"name": "remote", "backend": "sim", "min_workers": 0, "max_workers": 0}]},
                             Config)
    fleet = Fleet(config, Metrics(), spawn_local=False)
    assert fleet.runtimes["remote"].not_serving_reason() == (
        "no worker has registered in the worker registry ([registry] redis_url) yet")
    config = msgspec.convert({"pools": [{"name": "p", "backend": "sim", "min_workers": 0, "max_workers": 0}]}, Config)
    assert Fleet(config, Metrics(), spawn_local=False).runtimes["p"].not_serving_reason() == "no worker configured"
