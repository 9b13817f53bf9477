"""The Redis job store's connection and key layout, and the paging over its owner indexes.

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

Finished records get a Redis ``EXPIRE`` of the retention period; :meth:`RedisKeyspace.page_of` drops ids of
expired records from an owner index when it meets them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis


class RedisKeyspace:
    """One Redis connection and the names of the job store's keys under one prefix.

    Args:
        url: ``redis://host:port/db``.
        prefix: prefix of every key.
    """

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._redis: aioredis.Redis | None = None

    @property
    def redis(self) -> aioredis.Redis:
        """The client (raw bytes replies).

        Raises:
            RuntimeError: the keyspace is not connected.
        """
        if self._redis is None:
            raise RuntimeError("the Redis job store is not open")
        return self._redis

    def connect(self) -> aioredis.Redis:
        """Create the client (it connects on its first command) and return it."""
        self._redis = aioredis.Redis.from_url(self.url, decode_responses=False)
        return self._redis

    async def close(self) -> None:
        """Close the client, if any."""
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    def key(self, *parts: str) -> str:
        """Return ``P:part:part…``."""
        return ":".join((self.prefix, *parts))

    def queue_key(self, priority: int) -> str:
        """Return the key of the queue stream of ``priority``."""
        return self.key("q", str(priority))

    async def next_seq(self) -> int:
        """Return the next creation sequence number (an index score)."""
        return int(await self.redis.incr(self.key("seq")))

    async def page_of(self, index_key: str, limit: int, after: str | None,
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

    async def delete_all(self) -> int:
        """Delete every key under the prefix; return how many went."""
        removed = 0
        async for key in self.redis.scan_iter(match=self.prefix + ":*", count=1000):
            removed += await self.redis.delete(key)
        return removed
