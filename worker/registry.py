"""Register a worker in the Redis worker registry and keep it alive with a heartbeat (DESIGN.md, Processes).

``sluice worker --listen 0.0.0.0:9100 --registry redis://host:6379/0 --advertise 10.0.0.5:9100`` writes the keys
that :mod:`shared.registry_keys` lists.

Each heartbeat rewrites the whole entry in one transaction, so a worker comes back by itself after Redis lost its
keys (restart, flush) or a gateway dropped it during a network partition. A clean exit deletes the entry and
publishes ``leave``; a worker that dies just stops heart-beating and gateways drop it once its key expires.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import msgspec
import structlog
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from shared.addresses import parse_address
from shared.config import ConfigError, RegistryConfig
from shared.protocol import Hello
from shared.registry_keys import HASH_TTL_FACTOR, events_channel, index_key, registry_keys

log = structlog.get_logger("sluice.worker")


def resolve_advertise(listen: str, advertise: str | None) -> str:
    """Return the ``HOST:PORT`` gateways should connect to.

    Args:
        listen: the worker's ``--listen`` (``HOST:PORT`` or ``unix:PATH``).
        advertise: the ``--advertise`` flag, or None to use ``listen`` when it names a reachable TCP host.

    Raises:
        ConfigError: a Unix socket or a wildcard host without ``--advertise``, or a malformed address.
    """
    address = advertise or listen
    if address.startswith("unix:"):
        raise ConfigError("--registry needs a TCP address: pass --advertise HOST:PORT")
    parsed = parse_address(address, "--advertise" if advertise else "--listen")
    if not parsed.host:
        raise ConfigError(f"--advertise: expected HOST:PORT with a host gateways can reach, got {address!r}")
    if advertise is None and parsed.host in ("0.0.0.0", "::"):
        raise ConfigError(f"--listen {listen} is a wildcard address: pass --advertise HOST:PORT")
    return address


class WorkerRegistration:
    """This worker's entry in the Redis registry, and the heartbeat task that keeps it alive.

    Args:
        client: an asyncio Redis client (its socket timeout bounds each call).
        hello: the worker's ``Hello`` (its fields go into the hash).
        address: ``HOST:PORT`` gateways connect to.
        config: key prefix, heartbeat interval and TTL.
    """

    def __init__(self, client: aioredis.Redis, hello: Hello, address: str, config: RegistryConfig) -> None:
        self._client = client
        self.hello = hello
        self.address = address
        self._config = config
        self._hash_key, self._alive_key = registry_keys(config.key_prefix, hello.worker_id)
        self._fields = {key: str(value) for key, value in msgspec.structs.asdict(hello).items()}
        self._fields.update(address=address, incarnation=f"{os.getpid()}-{time.time():.6f}",
                            host=socket.gethostname(), pid=str(os.getpid()))
        self._task: asyncio.Task | None = None
        self.num_heartbeats = 0
        self.num_errors = 0

    @classmethod
    def from_url(cls, redis_url: str, hello: Hello, address: str, config: RegistryConfig) -> WorkerRegistration:
        """Connect to ``redis_url`` (timeouts from ``config.timeout_s``)."""
        client = aioredis.Redis.from_url(redis_url, socket_timeout=config.timeout_s,
                                         socket_connect_timeout=config.timeout_s)
        return cls(client, hello, address, config)

    async def start(self) -> None:
        """Register now and start the heartbeat task (owned here; :meth:`close` cancels it).

        Raises:
            RedisError, OSError: the first registration failed (the worker should not pretend to be registered).
        """
        await self._write()
        await self._client.publish(events_channel(self._config.key_prefix), f"join {self.hello.worker_id}")
        log.info("worker_registered", worker_id=self.hello.worker_id, address=self.address,
                 ttl_s=self._config.heartbeat_ttl_s)
        self._task = asyncio.create_task(self._heartbeat(), name="registry-heartbeat")

    async def close(self) -> None:
        """Stop the heartbeat, delete the entry and publish ``leave`` (errors are logged, never raised)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self._hash_key, self._alive_key)
                pipe.srem(index_key(self._config.key_prefix), self.hello.worker_id)
                pipe.publish(events_channel(self._config.key_prefix), f"leave {self.hello.worker_id}")
                await pipe.execute()
            log.info("worker_deregistered", worker_id=self.hello.worker_id)
        except (RedisError, OSError) as exc:
            log.warning("worker_deregister_failed", worker_id=self.hello.worker_id, error=str(exc))
        await self._client.aclose()

    async def _write(self) -> None:
        ttl_ms = int(self._config.heartbeat_ttl_s * 1000)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self._hash_key, mapping=self._fields)
            pipe.pexpire(self._hash_key, ttl_ms * HASH_TTL_FACTOR)
            pipe.set(self._alive_key, "1", px=ttl_ms)
            pipe.sadd(index_key(self._config.key_prefix), self.hello.worker_id)
            await pipe.execute()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._config.heartbeat_interval_s)
            try:
                await self._write()
            except (RedisError, OSError) as exc:
                self.num_errors += 1
                log.warning("worker_heartbeat_failed", worker_id=self.hello.worker_id, error=str(exc))
                continue
            self.num_heartbeats += 1
