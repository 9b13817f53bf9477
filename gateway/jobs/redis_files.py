"""The files of the Redis job store (the OpenAI Files API's records and content): one hash per file, an owner index.

``P:file:<id>`` holds ``{record, content}`` (the record as msgspec JSON, the content as raw bytes) and expires with
the file's ``expires_at``; ``P:owner:<o>:files`` lists the owner's file ids by creation sequence.
"""

from __future__ import annotations

import time

import msgspec

from gateway.jobs.models import FileRecord
from gateway.jobs.redis_keyspace import RedisKeyspace


class RedisFileStore:
    """Store, read, list and delete files in Redis; the :class:`~gateway.jobs.store.JobStore` file methods.

    Args:
        keys: the store's connection and key layout.
    """

    def __init__(self, keys: RedisKeyspace) -> None:
        self._keys = keys

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """See :meth:`JobStore.put_file`: the hash expires at ``record.expires_at`` (none when 0)."""
        key = self._keys.key("file", record.id)
        ttl_s = max(1, int(record.expires_at - time.time())) if record.expires_at else None
        seq = await self._keys.next_seq()
        async with self._keys.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"record": msgspec.json.encode(record), "content": content})
            if ttl_s is not None:
                pipe.expire(key, ttl_s)
            pipe.zadd(self._keys.key("owner", record.owner, "files"), {record.id: seq}, nx=True)
            await pipe.execute()

    async def get_file(self, file_id: str) -> FileRecord | None:
        """See :meth:`JobStore.get_file`."""
        data = await self._keys.redis.hget(self._keys.key("file", file_id), "record")
        return None if data is None else msgspec.json.decode(data, type=FileRecord)

    async def get_file_content(self, file_id: str) -> bytes | None:
        """See :meth:`JobStore.get_file_content`."""
        return await self._keys.redis.hget(self._keys.key("file", file_id), "content")

    async def list_files(self, owner: str, limit: int, after: str | None,
                         purpose: str | None = None, oldest_first: bool = False) -> tuple[list[FileRecord], bool]:
        """See :meth:`JobStore.list_files`."""
        return await self._keys.page_of(self._keys.key("owner", owner, "files"), limit, after, self.get_file,
                                        lambda record: purpose is None or record.purpose == purpose, oldest_first)

    async def delete_file(self, file_id: str) -> bool:
        """See :meth:`JobStore.delete_file`."""
        record = await self.get_file(file_id)
        if record is None:
            return False
        await self._keys.redis.delete(self._keys.key("file", file_id))
        await self._keys.redis.zrem(self._keys.key("owner", record.owner, "files"), file_id)
        return True
