"""The Redis job store: streams with a consumer group for the queue, hashes for state; shared by gateways.

:class:`RedisJobStore` is the :class:`~gateway.jobs.store.JobStore` facade over three parts:

- :class:`~gateway.jobs.redis_keyspace.RedisKeyspace`: the connection, the key layout (listed there) and the
  paging over owner indexes;
- :class:`~gateway.jobs.redis_files.RedisFileStore`: the files;
- :class:`~gateway.jobs.redis_queue.RedisJobQueue`: the priority streams and the lease of a running job (claim,
  renew, requeue, finish).

The store itself keeps the job and batch records: adding jobs under the per-owner limit, reading and listing them,
updating batches, and the summary. Finished records get a Redis ``EXPIRE`` of the retention period; owner indexes
drop ids of expired records lazily.
"""

from __future__ import annotations

import math
from typing import Any

import redis.asyncio as aioredis

from gateway.jobs.models import (
    BATCH_FINAL_STATUSES,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Batch,
    FileRecord,
    Job,
    JobsSummary,
)
from gateway.jobs.redis_files import RedisFileStore
from gateway.jobs.redis_keyspace import RedisKeyspace
from gateway.jobs.redis_queue import RedisJobQueue
from gateway.jobs.redis_scripts import (
    GROUP,
    RESERVE_LUA,
    UPDATE_BATCH_LUA,
    encode_field,
    from_hash,
    to_hash,
)
from gateway.jobs.store import JobStore, TooManyJobsError


class RedisJobStore(JobStore):
    """The job store in Redis (key layout: :mod:`gateway.jobs.redis_keyspace`).

    Args:
        url: ``redis://host:port/db``.
        prefix: prefix of every key (tests use a unique one and delete it afterwards).
    """

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._keys = RedisKeyspace(url, prefix)
        self._files = RedisFileStore(self._keys)
        self._queue = RedisJobQueue(self._keys)
        self._scripts: dict[str, Any] = {}

    @property
    def redis(self) -> aioredis.Redis:
        """The client (raises RuntimeError before :meth:`open`)."""
        return self._keys.redis

    def _key(self, *parts: str) -> str:
        return self._keys.key(*parts)

    async def open(self) -> None:
        """See :meth:`JobStore.open`: connect, load the scripts, create the consumer groups."""
        redis = self._keys.connect()
        for name, source in (("reserve", RESERVE_LUA), ("update_batch", UPDATE_BATCH_LUA)):
            self._scripts[name] = redis.register_script(source)
        await self._queue.open()

    async def close(self) -> None:
        """See :meth:`JobStore.close`."""
        await self._keys.close()

    # ----------------------------------------------------------------------------------------------- files

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """See :meth:`JobStore.put_file`."""
        await self._files.put_file(record, content)

    async def get_file(self, file_id: str) -> FileRecord | None:
        """See :meth:`JobStore.get_file`."""
        return await self._files.get_file(file_id)

    async def get_file_content(self, file_id: str) -> bytes | None:
        """See :meth:`JobStore.get_file_content`."""
        return await self._files.get_file_content(file_id)

    async def list_files(self, owner: str, limit: int, after: str | None,
                         purpose: str | None = None, oldest_first: bool = False) -> tuple[list[FileRecord], bool]:
        """See :meth:`JobStore.list_files`."""
        return await self._files.list_files(owner, limit, after, purpose, oldest_first)

    async def delete_file(self, file_id: str) -> bool:
        """See :meth:`JobStore.delete_file`."""
        return await self._files.delete_file(file_id)

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
                    self._queue.enqueue(pipe, job)
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
        return await self._keys.page_of(self._key("owner", owner, "jobs"), limit, after, self.get_job)

    async def count_active_jobs(self, owner: str) -> int:
        """See :meth:`JobStore.count_active_jobs`."""
        value = await self.redis.hget(self._key("active"), owner)
        return int(value or 0)

    async def claim(self, runner_id: str, lease_s: float, now_s: float) -> Job | None:
        """See :meth:`JobStore.claim` and :meth:`RedisJobQueue.claim`."""
        return await self._queue.claim(runner_id, lease_s, now_s)

    async def renew(self, job_id: str, runner_id: str, lease_s: float, now_s: float) -> bool:
        """See :meth:`JobStore.renew`."""
        return await self._queue.renew(job_id, runner_id, lease_s, now_s)

    async def requeue(self, job_id: str, runner_id: str, refund_attempt: bool = False) -> bool:
        """See :meth:`JobStore.requeue`."""
        return await self._queue.requeue(job_id, runner_id, refund_attempt)

    async def finish(self, job_id: str, status: str, now_s: float, *, result: bytes = b"",
                     error: dict[str, Any] | None = None, status_code: int = 0, request_id: str = "",
                     retention_s: float) -> bool:
        """See :meth:`JobStore.finish`."""
        return await self._queue.finish(job_id, status, now_s, result=result, error=error, status_code=status_code,
                                        request_id=request_id, retention_s=retention_s)

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
                pipe.xpending(self._keys.queue_key(priority), GROUP)
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
        return await self._keys.page_of(self._key("owner", owner, "batches"), limit, after, self.get_batch)

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
            await self.redis.expire(key, max(1, math.ceil(retention_s)))
            await self.redis.expire(self._key("batch", batch_id, "jobs"), max(1, math.ceil(retention_s)))
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
        return await self._keys.delete_all()
