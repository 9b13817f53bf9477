"""The Redis job store's queue: one stream per priority, a consumer group, and the lease of a running job.

Queue mechanics (Redis streams, https://redis.io/docs/latest/develop/data-types/streams/):

- submit: ``XADD P:q:<p>``; a runner claims with ``XREADGROUP ... >`` (highest priority stream first); the entry
  stays in the group's pending list (PEL) while the job runs — that is the lease.
- heartbeat: ``XCLAIM <stream> runners <me> 0 <entry> JUSTID`` resets the entry's idle time (only while the job
  hash still names this runner as ``lease_owner``).
- a runner that died stops renewing; after ``lease_timeout_s`` idle, any gateway's ``XAUTOCLAIM`` takes the entry.
- final state: a Lua script sets it only when the job has none (first writer wins), counts the batch line,
  ``XACK``s and ``XDEL``s the entry — all in one atomic step.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from gateway.jobs.models import MAX_PRIORITY, MIN_PRIORITY, Job
from gateway.jobs.redis_keyspace import RedisKeyspace
from gateway.jobs.redis_scripts import FINISH_LUA, GROUP, RENEW_LUA, REQUEUE_LUA, START_LUA, from_hash
from gateway.jobs.store import STORE_UNAVAILABLE_ERRORS

log = structlog.get_logger("sluice.gateway.jobs")


class RedisJobQueue:
    """Hand queued jobs to runners with leases, and write their final state; the lease lifecycle of
    :class:`~gateway.jobs.store.JobStore` (claim, renew, requeue, finish).

    Args:
        keys: the store's connection and key layout.
    """

    def __init__(self, keys: RedisKeyspace) -> None:
        self._keys = keys
        self._scripts: dict[str, Any] = {}
        self._next_autoclaim_s = 0.0

    async def open(self) -> None:
        """Load the scripts and create the consumer group of every priority stream (the keyspace is connected);
        with Redis unreachable, the gateway starts without them (its job endpoints answer 503 until Redis is back)
        and the first claim that reaches Redis creates them."""
        redis = self._keys.redis
        for name, source in (("finish", FINISH_LUA), ("start", START_LUA), ("renew", RENEW_LUA),
                             ("requeue", REQUEUE_LUA)):
            self._scripts[name] = redis.register_script(source)
        try:
            await self._create_groups()
        except STORE_UNAVAILABLE_ERRORS as exc:  # the first claim that reaches Redis creates them (NOGROUP)
            log.warning("job_store_unreachable_at_start", error=f"{type(exc).__name__}: {exc}")

    async def _create_groups(self) -> None:
        """Create the consumer group of every priority stream that has none (and the stream with it)."""
        for priority in range(MIN_PRIORITY, MAX_PRIORITY + 1):
            try:
                await self._keys.redis.xgroup_create(self._keys.queue_key(priority), GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def enqueue(self, pipe: Pipeline, job: Job) -> None:
        """Queue ``XADD``-ing the job's entry onto its priority stream in ``pipe`` (a transaction of the caller)."""
        pipe.xadd(self._keys.queue_key(job.priority), {"job": job.id})

    async def claim(self, runner_id: str, lease_s: float, now_s: float) -> Job | None:
        """See :meth:`JobStore.claim`: expired leases (``XAUTOCLAIM``, at most every ``lease_s / 4``), then
        ``XREADGROUP`` over the priority streams, highest first.

        A Redis that lost the streams' consumer groups (restarted without persistence, flushed) answers
        ``NOGROUP``: the groups are created again and the claim is tried once more, so the store serves the jobs
        submitted since instead of failing every claim until the gateway restarts.
        """
        try:
            return await self._claim(runner_id, lease_s, now_s)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
        await self._create_groups()
        return await self._claim(runner_id, lease_s, now_s)

    async def _claim(self, runner_id: str, lease_s: float, now_s: float) -> Job | None:
        redis = self._keys.redis
        lease_ms = max(1, int(lease_s * 1000))
        if now_s >= self._next_autoclaim_s:
            self._next_autoclaim_s = now_s + lease_s / 4
            for priority in range(MAX_PRIORITY, MIN_PRIORITY - 1, -1):
                stream = self._keys.queue_key(priority)
                cursor: bytes | str = "0-0"
                while True:
                    cursor, entries, *_ = await redis.xautoclaim(stream, GROUP, runner_id, lease_ms, cursor, count=1)
                    for entry_id, fields in entries:
                        job = await self._start(stream, entry_id, fields, runner_id, lease_s, now_s)
                        if job is not None:
                            self._next_autoclaim_s = now_s  # there may be more: look again next time
                            return job
                    if cursor in (b"0-0", "0-0"):
                        break
        for priority in range(MAX_PRIORITY, MIN_PRIORITY - 1, -1):
            stream = self._keys.queue_key(priority)
            while True:
                response = await redis.xreadgroup(GROUP, runner_id, {stream: ">"}, count=1)
                if not response:
                    break
                entry_id, fields = response[0][1][0]
                job = await self._start(stream, entry_id, fields, runner_id, lease_s, now_s)
                if job is not None:
                    return job
        return None

    async def _start(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes] | None, runner_id: str,
                     lease_s: float, now_s: float) -> Job | None:
        """Mark the entry's job running for ``runner_id``; return it, or None when the entry was stale."""
        if not fields or b"job" not in fields:  # the entry was deleted under us
            await self._keys.redis.xack(stream, GROUP, entry_id)
            return None
        job_key = self._keys.key("job", fields[b"job"].decode())
        started = await self._scripts["start"](
            keys=[job_key], args=[runner_id, repr(now_s + lease_s), repr(now_s), stream, entry_id])
        if not int(started):
            return None
        return await self._load(job_key)

    async def _load(self, job_key: str) -> Job | None:
        raw = await self._keys.redis.hgetall(job_key)
        return from_hash(raw, Job) if raw else None

    async def renew(self, job_id: str, runner_id: str, lease_s: float, now_s: float) -> bool:
        """See :meth:`JobStore.renew`."""
        renewed = await self._scripts["renew"](keys=[self._keys.key("job", job_id)],
                                               args=[runner_id, repr(now_s + lease_s)])
        return bool(int(renewed))

    async def requeue(self, job_id: str, runner_id: str, refund_attempt: bool = False) -> bool:
        """See :meth:`JobStore.requeue`."""
        job_key = self._keys.key("job", job_id)
        job = await self._load(job_key)
        if job is None:
            return False
        requeued = await self._scripts["requeue"](keys=[job_key],
                                                  args=[runner_id, self._keys.queue_key(job.priority),
                                                        int(refund_attempt)])
        return bool(int(requeued))

    async def finish(self, job_id: str, status: str, now_s: float, *, result: bytes = b"",
                     error: dict[str, Any] | None = None, status_code: int = 0, request_id: str = "",
                     retention_s: float) -> bool:
        """See :meth:`JobStore.finish`."""
        keys = self._keys
        written = await self._scripts["finish"](
            keys=[keys.key("job", job_id), keys.key("active"), keys.key("expiry")],
            args=[status, repr(now_s), result, "null" if error is None else json.dumps(error), status_code,
                  request_id, keys.prefix, repr(retention_s), job_id])
        return bool(int(written))
