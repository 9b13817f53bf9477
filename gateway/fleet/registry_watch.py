"""Watch the Redis worker registry: which remote workers joined, which left.

Workers write their entries under the keys :mod:`shared.registry_keys` lists. A gateway scans the index every
``poll_interval_s`` (and at once when the ``events`` channel hints at a join or leave): a worker whose alive key
exists is live; one whose alive key expired (it stopped heart-beating) or whose entry was deleted (clean exit) has
left. A worker that restarted under the same id (a new ``incarnation``) leaves and joins again, so the gateway
reconnects.

While Redis is unreachable nothing changes: known workers stay (their connections are the real liveness signal;
a dead worker's connection drops by itself) and the next successful scan catches up.

Dead entries (index member without an alive key) are removed from the index and their hash deleted by whichever
gateway sees them first, atomically, so a worker re-registering at the same moment is never deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from gateway.aio import wait_event
from shared.config import RegistryConfig
from shared.protocol import Hello
from shared.registry_keys import events_channel, index_key, registry_keys

log = structlog.get_logger("sluice.gateway")

# KEYS[1] index set, KEYS[2] alive key, KEYS[3] hash; ARGV[1] worker id. Forget a worker only if it is still dead.
_REAP_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SREM', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[3])
  return 1
end
return 0
"""


class RegistryEventKind(str, enum.Enum):
    """A change in the set of live workers."""

    JOIN = "join"
    LEAVE = "leave"


@dataclass(frozen=True)
class RegisteredWorker:
    """One live worker as the registry describes it.

    Attributes:
        worker_id: the worker's id (also ``hello.worker_id``).
        address: ``HOST:PORT`` to connect to.
        hello: the worker's ``Hello`` (model, backend, KV capacity, …).
        incarnation: changes when a worker with the same id restarts.
        host: the worker machine's hostname.
    """

    worker_id: str
    address: str
    hello: Hello
    incarnation: str
    host: str = ""


@dataclass(frozen=True)
class RegistryEvent:
    """A worker joined or left.

    Attributes:
        kind: join or leave.
        worker: the worker (for a leave: its last known entry).
        reason: why it left: ``deregistered`` (clean exit), ``heartbeat_expired``, ``restarted``; "" for a join.
    """

    kind: RegistryEventKind
    worker: RegisteredWorker
    reason: str = ""


def _decode(fields: dict[bytes, bytes]) -> RegisteredWorker | None:
    text = {key.decode(): value.decode() for key, value in fields.items()}
    try:
        hello = Hello(**{
            field.name: msgspec.convert(text[field.name], field.type, strict=False)
            for field in msgspec.structs.fields(Hello)
            if field.name in text
        })
        return RegisteredWorker(hello.worker_id, text["address"], hello, text.get("incarnation", ""),
                                text.get("host", ""))
    except (msgspec.ValidationError, KeyError, TypeError) as exc:
        log.warning("registry_entry_malformed", error=str(exc), fields=sorted(text))
        return None


class RegistryWatcher:
    """Turn the registry's contents into join/leave events for this gateway.

    Args:
        client: an asyncio Redis client (its socket timeout bounds each call).
        config: key prefix and poll interval.
    """

    def __init__(self, client: aioredis.Redis, config: RegistryConfig) -> None:
        self._client = client
        self._config = config
        self._prefix = config.key_prefix
        self._reap = client.register_script(_REAP_LUA)
        self.known: dict[str, RegisteredWorker] = {}
        self.num_errors = 0
        self._failing = False
        self._scanned = False  # a scan has succeeded once

    @classmethod
    def from_config(cls, config: RegistryConfig) -> RegistryWatcher:
        """Connect to ``config.redis_url`` (timeouts from ``config.timeout_s``)."""
        client = aioredis.Redis.from_url(config.redis_url, socket_timeout=config.timeout_s,
                                         socket_connect_timeout=config.timeout_s)
        return cls(client, config)

    async def close(self) -> None:
        """Close the Redis connection pool."""
        await self._client.aclose()

    async def poll_once(self) -> list[RegistryEvent]:
        """Scan the registry once and return what changed since the last scan (leaves first).

        Redis errors are logged and counted; the known set then stays as it is and no event is returned.
        """
        try:
            events = await self._scan()
        except (RedisError, OSError) as exc:
            self.num_errors += 1
            if not self._failing:
                log.warning("registry_unreachable_keeping_known_workers", error=str(exc), known=len(self.known))
            self._failing = True
            return []
        self._failing = False
        self._scanned = True
        for event in events:
            if event.kind is RegistryEventKind.JOIN:
                self.known[event.worker.worker_id] = event.worker
            elif self.known.get(event.worker.worker_id) == event.worker:
                del self.known[event.worker.worker_id]
            log.info("registry_" + event.kind.value, worker_id=event.worker.worker_id, address=event.worker.address,
                     model=event.worker.hello.model_id, reason=event.reason or None)
        return events

    def health(self) -> dict[str, Any]:
        """Return ``{"reachable", "errors", "known_workers"}`` for ``/status`` and metrics: whether the last scan
        read the registry (False before the first one succeeds), failed scans so far, live workers known."""
        return {"reachable": self._scanned and not self._failing, "errors": self.num_errors,
                "known_workers": len(self.known)}

    async def events(self) -> AsyncIterator[RegistryEvent]:
        """Yield joins and leaves forever: a scan every ``poll_interval_s``, or sooner on a pubsub hint.

        The pubsub listener is a task owned by this generator and cancelled when the generator is closed.
        """
        wake = asyncio.Event()
        listener = asyncio.create_task(self._listen(wake), name="registry-pubsub")
        try:
            while True:
                for event in await self.poll_once():
                    yield event
                await wait_event(wake, self._config.poll_interval_s)
                wake.clear()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _scan(self) -> list[RegistryEvent]:
        ids = sorted(member.decode() for member in await self._client.smembers(index_key(self._prefix)))
        async with self._client.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.exists(registry_keys(self._prefix, worker_id)[1])
            alive_flags = await pipe.execute() if ids else []
        live_ids = [worker_id for worker_id, alive in zip(ids, alive_flags) if alive]
        for worker_id, alive in zip(ids, alive_flags):
            if not alive:
                hash_key, alive_key = registry_keys(self._prefix, worker_id)
                await self._reap(keys=[index_key(self._prefix), alive_key, hash_key], args=[worker_id])
        async with self._client.pipeline(transaction=False) as pipe:
            for worker_id in live_ids:
                pipe.hgetall(registry_keys(self._prefix, worker_id)[0])
            entries = await pipe.execute() if live_ids else []
        live: dict[str, RegisteredWorker] = {}
        for fields in entries:
            worker = _decode(fields) if fields else None
            if worker is not None:
                live[worker.worker_id] = worker
        leaves: list[RegistryEvent] = []
        joins: list[RegistryEvent] = []
        for worker_id, worker in self.known.items():
            current = live.get(worker_id)
            if current is None:
                reason = "heartbeat_expired" if worker_id in ids else "deregistered"
                leaves.append(RegistryEvent(RegistryEventKind.LEAVE, worker, reason))
            elif current != worker:
                leaves.append(RegistryEvent(RegistryEventKind.LEAVE, worker, "restarted"))
                joins.append(RegistryEvent(RegistryEventKind.JOIN, current))
        for worker_id, worker in live.items():
            if worker_id not in self.known:
                joins.append(RegistryEvent(RegistryEventKind.JOIN, worker))
        return leaves + joins

    async def _listen(self, wake: asyncio.Event) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(events_channel(self._prefix))
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        wake.set()
            except (RedisError, OSError):
                pass  # the poll keeps going; try to subscribe again after a poll interval
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(self._config.poll_interval_s)
