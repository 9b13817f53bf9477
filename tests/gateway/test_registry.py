"""RegistryWatcher against the real Redis at 127.0.0.1:6379 (``make redis`` starts it), each test under its own key
prefix: joins and clean leaves, a killed ``sluice worker`` process dropped once its heartbeat expires (and reaped
from the index), a restart under the same id, malformed entries, an unreachable Redis, and the pubsub hint."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from redis import asyncio as aioredis

from gateway.fleet.registry_watch import RegistryEventKind, RegistryWatcher
from shared.config import RegistryConfig
from shared.protocol import Hello
from shared.registry_keys import index_key, registry_keys
from tests.support.server import SluiceProcess, free_port
from worker.registry import WorkerRegistration

REDIS_URL = "redis://127.0.0.1:6379/0"
JOIN, LEAVE = RegistryEventKind.JOIN, RegistryEventKind.LEAVE


@pytest.fixture
def prefix(redis_prefix):
    """A fresh Redis key prefix, cleaned up afterwards (``tests/conftest.py``)."""
    return redis_prefix


def hello(worker_id: str, model_id: str = "m") -> Hello:
    return Hello(worker_id=worker_id, model_id=model_id, backend="sim", device="sim:roofline", block_size_tokens=16,
                 num_kv_blocks=100, kv_capacity_tokens=1600, max_num_seqs=8, max_model_len_tokens=4096)


def config(prefix: str, **overrides) -> RegistryConfig:
    values = dict(redis_url=REDIS_URL, key_prefix=prefix, heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5,
                  poll_interval_s=0.1, timeout_s=0.5)
    values.update(overrides)
    return RegistryConfig(**values)


async def test_join_then_clean_leave(prefix):
    watcher = RegistryWatcher.from_config(config(prefix))
    assert await watcher.poll_once() == []
    a = WorkerRegistration.from_url(REDIS_URL, hello("a", "big"), "127.0.0.1:9001", config(prefix))
    b = WorkerRegistration.from_url(REDIS_URL, hello("b", "small"), "127.0.0.1:9002", config(prefix))
    await a.start()
    await b.start()
    events = await watcher.poll_once()
    assert [(e.kind, e.worker.worker_id, e.worker.address, e.worker.hello.model_id) for e in events] == [
        (JOIN, "a", "127.0.0.1:9001", "big"), (JOIN, "b", "127.0.0.1:9002", "small")]
    assert events[0].worker.hello == hello("a", "big")  # every Hello field survives the round trip
    assert await watcher.poll_once() == []  # heartbeats change nothing
    await a.close()
    [event] = await watcher.poll_once()
    assert (event.kind, event.worker.worker_id, event.reason) == (LEAVE, "a", "deregistered")
    assert sorted(watcher.known) == ["b"]
    await b.close()
    await watcher.close()


async def test_killed_worker_process_is_dropped_after_its_heartbeat_ttl_and_reaped(prefix, tmp_path):
    worker = SluiceProcess('[worker]\nbackend = "sim"\n[sim]\nkv_cache_gib = 1.0\n'
                           f'[registry]\nkey_prefix = "{prefix}"\nheartbeat_interval_s = 0.2\nheartbeat_ttl_s = 1.0\n',
                           tmp_path, command="worker", ready="none",
                           args=["--registry", REDIS_URL, "--worker-id", "doomed"])
    port, process = worker.port, worker.start().process
    watcher = RegistryWatcher.from_config(config(prefix, heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0))
    try:
        events = []
        deadline = time.monotonic() + 120.0
        while not events:
            assert process.poll() is None and time.monotonic() < deadline, "worker never registered"
            events = await watcher.poll_once()
            await asyncio.sleep(0.1)
        assert [(e.kind, e.worker.worker_id, e.worker.address) for e in events] == [
            (JOIN, "doomed", f"127.0.0.1:{port}")]
        process.send_signal(signal.SIGKILL)  # no deregistration: only the heartbeat stops
        process.wait()
        killed_s = time.monotonic()
        events = []
        while not events:
            assert time.monotonic() - killed_s < 5.0, "dead worker never dropped"
            events = await watcher.poll_once()
            await asyncio.sleep(0.05)
        dropped_after_s = time.monotonic() - killed_s
        assert [(e.kind, e.reason) for e in events] == [(LEAVE, "heartbeat_expired")]
        assert 0.5 < dropped_after_s < 2.0  # about one TTL (1 s) after the last heartbeat
        client = aioredis.Redis.from_url(REDIS_URL)
        assert await client.smembers(index_key(prefix)) == set()  # reaped: no scan finds it again
        assert not await client.exists(registry_keys(prefix, "doomed")[0])
        await client.aclose()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await watcher.close()


async def test_restart_under_the_same_id_is_a_leave_and_a_join(prefix):
    watcher = RegistryWatcher.from_config(config(prefix))
    first = WorkerRegistration.from_url(REDIS_URL, hello("w"), "127.0.0.1:9001", config(prefix))
    await first.start()
    await watcher.poll_once()
    second = WorkerRegistration.from_url(REDIS_URL, hello("w"), "127.0.0.1:9009", config(prefix))
    await second.start()  # a new process (new incarnation) overwrote the entry
    events = await watcher.poll_once()
    assert [(e.kind, e.worker.address, e.reason) for e in events] == [
        (LEAVE, "127.0.0.1:9001", "restarted"), (JOIN, "127.0.0.1:9009", "")]
    assert watcher.known["w"].address == "127.0.0.1:9009"
    await first.close()  # (deletes the shared entry: the second one is gone too until its next heartbeat)
    await second.close()
    await watcher.close()


async def test_malformed_entry_is_ignored(prefix):
    client = aioredis.Redis.from_url(REDIS_URL)
    hash_key, alive_key = registry_keys(prefix, "junk")
    await client.hset(hash_key, mapping={"worker_id": "junk", "num_kv_blocks": "many"})
    await client.set(alive_key, "1", px=5000)
    await client.sadd(index_key(prefix), "junk")
    watcher = RegistryWatcher.from_config(config(prefix))
    assert await watcher.poll_once() == []
    await client.aclose()
    await watcher.close()


async def test_unreachable_redis_keeps_known_workers(prefix):
    watcher = RegistryWatcher.from_config(config(prefix))
    registration = WorkerRegistration.from_url(REDIS_URL, hello("a"), "127.0.0.1:9001", config(prefix))
    await registration.start()
    assert watcher.health() == {"reachable": False, "errors": 0, "known_workers": 0}  # no scan yet
    assert len(await watcher.poll_once()) == 1
    assert watcher.health() == {"reachable": True, "errors": 0, "known_workers": 1}
    port = free_port()  # nothing listens there
    broken = RegistryWatcher.from_config(config(prefix, redis_url=f"redis://127.0.0.1:{port}/0", timeout_s=0.2))
    broken.known.update(watcher.known)
    assert await broken.poll_once() == []
    assert sorted(broken.known) == ["a"] and broken.num_errors == 1
    # README trial 15: nothing but a log line told that the registry was away (/status, sluice_registry_reachable)
    assert broken.health() == {"reachable": False, "errors": 1, "known_workers": 1}
    await registration.close()
    await broken.close()
    await watcher.close()


async def test_events_wake_on_the_pubsub_hint_before_the_poll_interval(prefix):
    watcher = RegistryWatcher.from_config(config(prefix, poll_interval_s=30.0))
    stream = watcher.events()
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.3)  # first scan done (empty), pubsub subscribed
    registration = WorkerRegistration.from_url(REDIS_URL, hello("a"), "127.0.0.1:9001", config(prefix))
    start_s = time.monotonic()
    await registration.start()
    event = await asyncio.wait_for(first, 5.0)
    assert (event.kind, event.worker.worker_id) == (JOIN, "a")
    assert time.monotonic() - start_s < 2.0  # not the 30 s poll interval
    await registration.close()
    event = await asyncio.wait_for(anext(stream), 5.0)
    assert (event.kind, event.reason) == (LEAVE, "deregistered")
    await stream.aclose()
    await watcher.close()
