"""The Redis job store: streams with a consumer group for the queue, hashes for state; shared by gateways.

Keys (``P`` = ``jobs.redis_key_prefix``)::

    P:q:<priority>         stream, one per priority 0–9; entries {job: <id>}; consumer group "runners"
    P:job:<id>             hash: the Job's fields
    P:batch:<id>           hash: the Batch's fields (counters num_completed / num_failed change atomically)
    P:batch:<id>:jobs      list: job ids in line order
    P:file:<id>            hash: {record, content}
    P:owner:<o>:jobs|batches|files   sorted sets of ids by creation sequence (listing, newest first)
    P:active               hash owner → unfinished jobs (the max_jobs_per_key limit)
    P:expiry               sorted set of unfinished job ids by expires_at
    P:open_batches         set of batch ids not in a final status
    P:seq                  creation sequence counter

Queue mechanics (Redis streams, https://redis.io/docs/latest/develop/data-types/streams/):

- submit: ``XADD P:q:<p>``; a runner claims with ``XREADGROUP ... >`` (highest priority stream first); the entry
  stays in the group's pending list (PEL) while the job runs — that is the lease.
- heartbeat: ``XCLAIM <stream> runners <me> 0 <entry> JUSTID`` resets the entry's idle time (only while the job
  hash still names this runner as ``lease_owner``).
- a runner that died stops renewing; after ``lease_timeout_s`` idle, any gateway's ``XAUTOCLAIM`` takes the entry.
- final state: a Lua script sets it only when the job has none (first writer wins), counts the batch line,
  ``XACK``s and ``XDEL``s the entry — all in one atomic step.

Finished records get a Redis ``EXPIRE`` of the retention period; owner indexes drop ids of expired records lazily.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.jobs.models import (
    BATCH_FINAL_STATUSES,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Batch,
    FileRecord,
    Job,
    JobsSummary,
)
from gateway.jobs.redis_scripts import (
    FINISH_LUA,
    GROUP,
    RENEW_LUA,
    REQUEUE_LUA,
    RESERVE_LUA,
    START_LUA,
    UPDATE_BATCH_LUA,
    encode_field,
    from_hash,
    to_hash,
)
from gateway.jobs.store import JobStore, TooManyJobsError

class RedisJobStore(JobStore):
    """The job store in Redis (see the module docstring for the key layout).

    Args:
        url: ``redis://host:port/db``.
        prefix: prefix of every key (tests use a unique one and delete it afterwards).
    """

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._redis: aioredis.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._next_autoclaim_s = 0.0

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("the Redis job store is not open")
        return self._redis

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _queue_key(self, priority: int) -> str:
        return self._key("q", str(priority))

    async def open(self) -> None:
        """See :meth:`JobStore.open`: connect, load the scripts, create the consumer groups."""
        self._redis = aioredis.Redis.from_url(self.url, decode_responses=False)
        for name, source in (("finish", FINISH_LUA), ("start", START_LUA), ("renew", RENEW_LUA),
                             ("requeue", REQUEUE_LUA), ("reserve", RESERVE_LUA),
                             ("update_batch", UPDATE_BATCH_LUA)):
            self._scripts[name] = self._redis.register_script(source)
        for priority in range(MIN_PRIORITY, MAX_PRIORITY + 1):
            try:
                await self._redis.xgroup_create(self._queue_key(priority), GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def close(self) -> None:
        """See :meth:`JobStore.close`."""
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def _next_seq(self) -> int:
        return int(await self.redis.incr(self._key("seq")))

    async def _page_of(self, index_key: str, limit: int, after: str | None,
                       load: Callable[[str], Awaitable[Any]], keep: Callable[[Any], bool] = bool,
                       oldest_first: bool = False) -> tuple[list, bool]:
        """Return one page of records from a sorted-set index (newest first, strictly before ``after``; or oldest
        first, strictly after it).

        Args:
            index_key: the owner's index (id → creation sequence).
            limit: records per page.
            after: cursor id, or None.
            load: id → record, or None when the record expired (its id is then dropped from the index).
            keep: filter on loaded records.
            oldest_first: ascending creation order.

        Returns:
            (up to ``limit`` records, whether more matching records follow).
        """
        bound = "-inf" if oldest_first else "+inf"
        if after is not None:
            score = await self.redis.zscore(index_key, after)
            if score is None:
                return [], False
            bound = f"({int(score)}"
        records: list = []
        while len(records) <= limit:
            if oldest_first:
                entries = await self.redis.zrangebyscore(index_key, bound, "+inf", start=0, num=limit + 1,
                                                         withscores=True)
            else:
                entries = await self.redis.zrevrangebyscore(index_key, bound, "-inf", start=0, num=limit + 1,
                                                            withscores=True)
            for record_id, _ in entries:
                record = await load(record_id.decode())
                if record is None:
                    await self.redis.zrem(index_key, record_id)
                elif keep(record):
                    records.append(record)
            if len(entries) <= limit:
                break  # the index is exhausted
            bound = f"({int(entries[-1][1])}"
        return records[:limit], len(records) > limit

    # ----------------------------------------------------------------------------------------------- files

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """See :meth:`JobStore.put_file`."""
        key = self._key("file", record.id)
        ttl_s = max(1, int(record.expires_at - time.time())) if record.expires_at else None
        seq = await self._next_seq()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"record": msgspec.json.encode(record), "content": content})
            if ttl_s is not None:
                pipe.expire(key, ttl_s)
            pipe.zadd(self._key("owner", record.owner, "files"), {record.id: seq}, nx=True)
            await pipe.execute()

    async def get_file(self, file_id: str) -> FileRecord | None:
        """See :meth:`JobStore.get_file`."""
        data = await self.redis.hget(self._key("file", file_id), "record")
        return None if data is None else msgspec.json.decode(data, type=FileRecord)

    async def get_file_content(self, file_id: str) -> bytes | None:
        """See :meth:`JobStore.get_file_content`."""
        return await self.redis.hget(self._key("file", file_id), "content")

    async def list_files(self, owner: str, limit: int, after: str | None,
                         purpose: str | None = None, oldest_first: bool = False) -> tuple[list[FileRecord], bool]:
        """See :meth:`JobStore.list_files`."""
        return await self._page_of(self._key("owner", owner, "files"), limit, after, self.get_file,
                                   lambda record: purpose is None or record.purpose == purpose, oldest_first)

    async def delete_file(self, file_id: str) -> bool:
        """See :meth:`JobStore.delete_file`."""
        record = await self.get_file(file_id)
        if record is None:
            return False
        await self.redis.delete(self._key("file", file_id))
        await self.redis.zrem(self._key("owner", record.owner, "files"), file_id)
        return True

    # ----------------------------------------------------------------------------------------------- jobs

    async def add_jobs(self, jobs: list[Job], max_active_per_owner: int, batch: Batch | None = None) -> None:
        """See :meth:`JobStore.add_jobs`: reserve the owner's quota (Lua), then add everything in one MULTI."""
        if not jobs and batch is None:
            return
        owner = jobs[0].owner if jobs else batch.owner
        active_key = self._key("active")
        if jobs:
            count = int(await self._scripts["reserve"](keys=[active_key],
                                                       args=[owner, len(jobs), max_active_per_owner]))
            if count < 0:
                raise TooManyJobsError(-count - 1, max_active_per_owner)
        try:
            first_seq = int(await self.redis.incrby(self._key("seq"), len(jobs) + 1)) - len(jobs)
            async with self.redis.pipeline(transaction=True) as pipe:
                for i, job in enumerate(jobs):
                    pipe.hset(self._key("job", job.id), mapping=to_hash(job))
                    if job.expires_at:
                        pipe.zadd(self._key("expiry"), {job.id: job.expires_at})
                    if not job.batch_id:
                        pipe.zadd(self._key("owner", owner, "jobs"), {job.id: first_seq + i})
                if batch is not None:
                    pipe.hset(self._key("batch", batch.id), mapping=to_hash(batch))
                    if jobs:
                        pipe.rpush(self._key("batch", batch.id, "jobs"), *[job.id for job in jobs])
                    pipe.zadd(self._key("owner", owner, "batches"), {batch.id: first_seq - 1})
                    if batch.status not in BATCH_FINAL_STATUSES:
                        pipe.sadd(self._key("open_batches"), batch.id)
                for job in jobs:
                    pipe.xadd(self._queue_key(job.priority), {"job": job.id})
                await pipe.execute()
        except BaseException:
            if jobs:
                await self.redis.hincrby(active_key, owner, -len(jobs))
            raise

    async def get_job(self, job_id: str) -> Job | None:
        """See :meth:`JobStore.get_job`."""
        raw = await self.redis.hgetall(self._key("job", job_id))
        return from_hash(raw, Job) if raw else None

    async def list_jobs(self, owner: str, limit: int, after: str | None) -> tuple[list[Job], bool]:
        """See :meth:`JobStore.list_jobs`."""
        return await self._page_of(self._key("owner", owner, "jobs"), limit, after, self.get_job)

    async def count_active_jobs(self, owner: str) -> int:
        """See :meth:`JobStore.count_active_jobs`."""
        value = await self.redis.hget(self._key("active"), owner)
        return int(value or 0)

    async def claim(self, runner_id: str, lease_s: float, now_s: float) -> Job | None:
        """See :meth:`JobStore.claim`: expired leases (``XAUTOCLAIM``, at most every ``lease_s / 4``), then
        ``XREADGROUP`` over the priority streams, highest first."""
        lease_ms = max(1, int(lease_s * 1000))
        if now_s >= self._next_autoclaim_s:
            self._next_autoclaim_s = now_s + lease_s / 4
            for priority in range(MAX_PRIORITY, MIN_PRIORITY - 1, -1):
                stream = self._queue_key(priority)
                cursor: bytes | str = "0-0"
                while True:
                    cursor, entries, *_ = await self.redis.xautoclaim(stream, GROUP, runner_id, lease_ms, cursor,
                                                                      count=1)
                    for entry_id, fields in entries:
                        job = await self._start(stream, entry_id, fields, runner_id, lease_s, now_s)
                        if job is not None:
                            self._next_autoclaim_s = now_s  # there may be more: look again next time
                            return job
                    if cursor in (b"0-0", "0-0"):
                        break
        for priority in range(MAX_PRIORITY, MIN_PRIORITY - 1, -1):
            stream = self._queue_key(priority)
            while True:
                response = await self.redis.xreadgroup(GROUP, runner_id, {stream: ">"}, count=1)
                if not response:
                    break
                entry_id, fields = response[0][1][0]
                job = await self._start(stream, entry_id, fields, runner_id, lease_s, now_s)
                if job is not None:
                    return job
        return None

    async def _start(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes] | None, runner_id: str,
                     lease_s: float, now_s: float) -> Job | None:
        if not fields or b"job" not in fields:  # the entry was deleted under us
            await self.redis.xack(stream, GROUP, entry_id)
            return None
        job_key = self._key("job", fields[b"job"].decode())
        started = await self._scripts["start"](
            keys=[job_key], args=[runner_id, repr(now_s + lease_s), repr(now_s), stream, entry_id])
        if not int(started):
            return None
        raw = await self.redis.hgetall(job_key)
        return from_hash(raw, Job) if raw else None

    async def renew(self, job_id: str, runner_id: str, lease_s: float, now_s: float) -> bool:
        """See :meth:`JobStore.renew`."""
        renewed = await self._scripts["renew"](keys=[self._key("job", job_id)],
                                               args=[runner_id, repr(now_s + lease_s)])
        return bool(int(renewed))

    async def requeue(self, job_id: str, runner_id: str, refund_attempt: bool = False) -> bool:
        """See :meth:`JobStore.requeue`."""
        job = await self.get_job(job_id)
        if job is None:
            return False
        requeued = await self._scripts["requeue"](keys=[self._key("job", job_id)],
                                                  args=[runner_id, self._queue_key(job.priority),
                                                        int(refund_attempt)])
        return bool(int(requeued))

    async def finish(self, job_id: str, status: str, now_s: float, *, result: bytes = b"",
                     error: dict[str, Any] | None = None, status_code: int = 0, request_id: str = "",
                     retention_s: float) -> bool:
        """See :meth:`JobStore.finish`."""
        written = await self._scripts["finish"](
            keys=[self._key("job", job_id), self._key("active"), self._key("expiry")],
            args=[status, repr(now_s), result, "null" if error is None else json.dumps(error), status_code,
                  request_id, self.prefix, repr(retention_s), job_id])
        return bool(int(written))

    async def delete_job(self, job_id: str) -> bool:
        """See :meth:`JobStore.delete_job`."""
        job = await self.get_job(job_id)
        if job is None or not job.is_final:
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("job", job_id))
            pipe.zrem(self._key("owner", job.owner, "jobs"), job_id)
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    async def summary(self, now_s: float) -> JobsSummary:
        """See :meth:`JobStore.summary`: unfinished = the sum of ``P:active``, running = the consumer group's
        pending entries (``XPENDING``) over the priority streams; finished counts and the oldest queued age are
        None (they need a scan)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hvals(self._key("active"))
            pipe.scard(self._key("open_batches"))
            for priority in range(MIN_PRIORITY, MAX_PRIORITY + 1):
                pipe.xpending(self._queue_key(priority), GROUP)
            active_counts, num_batches, *pending = await pipe.execute(raise_on_error=False)
        num_active = sum(int(value) for value in active_counts)
        num_running = sum(int(entry["pending"]) for entry in pending if isinstance(entry, dict))
        return JobsSummary(queued=max(0, num_active - num_running), running=num_running,
                           batches_in_progress=int(num_batches))

    async def batch_jobs(self, batch_id: str) -> list[Job]:
        """See :meth:`JobStore.batch_jobs`."""
        ids = await self.redis.lrange(self._key("batch", batch_id, "jobs"), 0, -1)
        jobs: list[Job] = []
        for start in range(0, len(ids), 256):
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in ids[start:start + 256]:
                    pipe.hgetall(self._key("job", job_id.decode()))
                for raw in await pipe.execute():
                    if raw:
                        jobs.append(from_hash(raw, Job))
        return jobs

    async def due_jobs(self, now_s: float, limit: int) -> list[str]:
        """See :meth:`JobStore.due_jobs`."""
        ids = await self.redis.zrangebyscore(self._key("expiry"), "-inf", f"({now_s!r}", start=0, num=limit)
        return [job_id.decode() for job_id in ids]

    # ----------------------------------------------------------------------------------------------- batches

    async def get_batch(self, batch_id: str) -> Batch | None:
        """See :meth:`JobStore.get_batch`."""
        raw = await self.redis.hgetall(self._key("batch", batch_id))
        return from_hash(raw, Batch) if raw and b"id" in raw else None

    async def list_batches(self, owner: str, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """See :meth:`JobStore.list_batches`."""
        return await self._page_of(self._key("owner", owner, "batches"), limit, after, self.get_batch)

    async def update_batch(self, batch_id: str, expected_statuses: frozenset[str], retention_s: float,
                           **fields: Any) -> Batch | None:
        """See :meth:`JobStore.update_batch`."""
        key = self._key("batch", batch_id)
        args: list[Any] = [",".join(sorted(expected_statuses))]
        for name, value in fields.items():
            if name not in Batch.__struct_fields__ or name in ("num_completed", "num_failed"):
                raise ValueError(f"update_batch: cannot set {name!r}")
            args += [name, encode_field(value)]
        if not int(await self._scripts["update_batch"](keys=[key], args=args)):
            return None
        batch = await self.get_batch(batch_id)
        if batch is not None and batch.is_final:
            await self.redis.srem(self._key("open_batches"), batch_id)
            await self.redis.expire(key, max(1, int(retention_s)))
            await self.redis.expire(self._key("batch", batch_id, "jobs"), max(1, int(retention_s)))
        return batch

    async def open_batch_ids(self) -> list[str]:
        """See :meth:`JobStore.open_batch_ids`."""
        ids = await self.redis.smembers(self._key("open_batches"))
        return sorted(batch_id.decode() for batch_id in ids)

    async def purge(self, now_s: float) -> int:
        """See :meth:`JobStore.purge`: finished records carry a Redis ``EXPIRE``; indexes are cleaned lazily."""
        return 0

    async def delete_all(self) -> int:
        """Delete every key under this store's prefix (tests); return how many went."""
        removed = 0
        async for key in self.redis.scan_iter(match=self.prefix + ":*", count=1000):
            removed += await self.redis.delete(key)
        return removed
