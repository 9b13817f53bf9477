"""Worker registration in the real Redis at 127.0.0.1:6379 (``make redis`` starts it), each test under its own key
prefix: the entry's layout and TTLs, the heartbeat (and re-registration after Redis lost the keys), clean
deregistration, and a real ``sluice worker --registry --advertise`` process (sim backend) end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.config import ConfigError, RegistryConfig
from shared.protocol import Hello, gateway_codec
from tests.support.server import REPO_ROOT, SluiceProcess, free_port
from worker.registry import WorkerRegistration, events_channel, index_key, registry_keys, resolve_advertise

REDIS_URL = "redis://127.0.0.1:6379/0"
WORKER_START_TIMEOUT_S = 120.0


@pytest.fixture
def prefix(redis_prefix):
    """A fresh Redis key prefix, cleaned up afterwards (``tests/conftest.py``)."""
    return redis_prefix


def hello(worker_id: str = "w1") -> Hello:
    return Hello(worker_id=worker_id, model_id="m", backend="sim", device="sim:roofline", block_size_tokens=16,
                 num_kv_blocks=100, kv_capacity_tokens=1600, max_num_seqs=8, max_model_len_tokens=4096,
                 attention_backend="sim")


def test_resolve_advertise():
    assert resolve_advertise("127.0.0.1:9100", None) == "127.0.0.1:9100"
    assert resolve_advertise("0.0.0.0:9100", "10.0.0.5:9100") == "10.0.0.5:9100"
    for listen, advertise in (("0.0.0.0:9100", None), ("unix:/tmp/w.sock", None), ("x", "nohost")):
        with pytest.raises(ConfigError):
            resolve_advertise(listen, advertise)


async def test_entry_layout_heartbeat_and_clean_deregistration(prefix):
    config = RegistryConfig(key_prefix=prefix, heartbeat_interval_s=0.1, heartbeat_ttl_s=0.4)
    registration = WorkerRegistration.from_url(REDIS_URL, hello(), "127.0.0.1:9100", config)
    client = aioredis.Redis.from_url(REDIS_URL)
    pubsub = client.pubsub()
    await pubsub.subscribe(events_channel(prefix))
    await registration.start()
    hash_key, alive_key = registry_keys(prefix, "w1")
    fields = {k.decode(): v.decode() for k, v in (await client.hgetall(hash_key)).items()}
    assert fields["address"] == "127.0.0.1:9100"
    assert (fields["model_id"], fields["num_kv_blocks"], fields["backend"]) == ("m", "100", "sim")
    assert fields["pid"] == str(os.getpid())
    assert await client.smembers(index_key(prefix)) == {b"w1"}
    assert 0 < await client.pttl(alive_key) <= 400
    await asyncio.sleep(1.0)  # 2.5 TTLs: only the heartbeat keeps it
    assert await client.exists(alive_key)
    assert registration.num_heartbeats >= 5
    await client.delete(hash_key, alive_key)  # Redis lost the keys (restart, flush): the next heartbeat rewrites
    await asyncio.sleep(0.3)
    assert await client.exists(alive_key) and (await client.hgetall(hash_key))[b"address"] == b"127.0.0.1:9100"
    await registration.close()
    assert not await client.exists(hash_key, alive_key)
    assert await client.smembers(index_key(prefix)) == set()
    messages = []
    deadline = time.monotonic() + 1.0
    while len(messages) < 2 and time.monotonic() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is not None:  # None: nothing yet, or the subscribe confirmation
            messages.append(message["data"].decode())
    assert messages == ["join w1", "leave w1"]
    await pubsub.aclose()
    await client.aclose()


async def test_first_registration_failure_raises():
    port = free_port()  # nothing listens there
    config = RegistryConfig(key_prefix="unused", timeout_s=0.3)
    registration = WorkerRegistration.from_url(f"redis://127.0.0.1:{port}/0", hello(), "127.0.0.1:1", config)
    with pytest.raises(RedisConnectionError):
        await registration.start()
    await registration.close()  # logs, never raises


def start_worker(tmp_path: Path, prefix: str, port: int, *extra: str) -> subprocess.Popen:
    config_text = ('[worker]\nbackend = "sim"\n[sim]\nkv_cache_gib = 1.0\n'
                   f'[registry]\nkey_prefix = "{prefix}"\nheartbeat_interval_s = 0.2\nheartbeat_ttl_s = 1.0\n')
    worker = SluiceProcess(config_text, tmp_path, command="worker", port=port, ready="none",
                           args=["--registry", REDIS_URL, *extra])
    return worker.start().process


async def test_sluice_worker_process_registers_serves_its_advertised_address_and_deregisters(prefix, tmp_path):
    port = free_port()
    process = start_worker(tmp_path, prefix, port, "--advertise", f"127.0.0.1:{port}", "--worker-id", "proc-1")
    client = aioredis.Redis.from_url(REDIS_URL)
    hash_key, alive_key = registry_keys(prefix, "proc-1")
    try:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while not await client.exists(alive_key):
            assert process.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "worker never registered"
            await asyncio.sleep(0.1)
        fields = {k.decode(): v.decode() for k, v in (await client.hgetall(hash_key)).items()}
        assert (fields["address"], fields["backend"]) == (f"127.0.0.1:{port}", "sim")
        # the advertised address serves the protocol, and its Hello matches the registry entry
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        message = await gateway_codec().read(reader)
        assert isinstance(message, Hello) and message.worker_id == "proc-1"
        assert str(message.num_kv_blocks) == fields["num_kv_blocks"]
        writer.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not await client.exists(hash_key, alive_key)
        assert b"proc-1" not in await client.smembers(index_key(prefix))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await client.aclose()


def test_registry_without_a_reachable_tcp_address_is_a_usage_error_before_loading_anything():
    for listen in ("0.0.0.0:1", "unix:/tmp/sluice-test-never.sock"):
        result = subprocess.run(
            [sys.executable, "-m", "sluice.cli", "worker", "--listen", listen, "--registry", REDIS_URL],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "--advertise" in result.stderr
