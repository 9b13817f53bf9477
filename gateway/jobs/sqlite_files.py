"""The files of the SQLite job store (the OpenAI Files API's records and content): rows of the ``files`` table.

A row keeps the record as msgspec JSON and the content as a blob, with ``owner``, ``purpose`` and ``expires_at``
in columns of their own for listing and purging.
"""

from __future__ import annotations

import sqlite3

import msgspec

from gateway.jobs.models import FileRecord
from gateway.jobs.sqlite_connection import SqliteConnection


class SqliteFileStore:
    """Store, read, list and delete files in SQLite; the :class:`~gateway.jobs.store.JobStore` file methods.

    Args:
        db: the store's connection.
    """

    def __init__(self, db: SqliteConnection) -> None:
        self._db = db

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        """See :meth:`JobStore.put_file`."""
        encoded = msgspec.json.encode(record)

        def put(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO files (id, owner, purpose, expires_at, record, content) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET record = excluded.record, content = excluded.content, "
                "expires_at = excluded.expires_at",
                (record.id, record.owner, record.purpose, record.expires_at, encoded, content))

        await self._db.run(put)

    async def get_file(self, file_id: str) -> FileRecord | None:
        """See :meth:`JobStore.get_file`."""
        row = await self._db.run(lambda c: c.execute("SELECT record FROM files WHERE id = ?", (file_id,)).fetchone())
        return None if row is None else msgspec.json.decode(row["record"], type=FileRecord)

    async def get_file_content(self, file_id: str) -> bytes | None:
        """See :meth:`JobStore.get_file_content`."""
        row = await self._db.run(
            lambda c: c.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone())
        return None if row is None else bytes(row["content"])

    async def list_files(self, owner: str, limit: int, after: str | None,
                         purpose: str | None = None, oldest_first: bool = False) -> tuple[list[FileRecord], bool]:
        """See :meth:`JobStore.list_files`."""

        def page(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            sql, params = "SELECT record FROM files WHERE owner = ?", [owner]
            if purpose is not None:
                sql += " AND purpose = ?"
                params.append(purpose)
            if after is not None:
                # an unknown cursor matches nothing, in either order
                sql += (" AND seq > COALESCE((SELECT seq FROM files WHERE id = ? AND owner = ?), 1e18)" if oldest_first
                        else " AND seq < COALESCE((SELECT seq FROM files WHERE id = ? AND owner = ?), -1)")
                params += [after, owner]
            sql += " ORDER BY seq ASC LIMIT ?" if oldest_first else " ORDER BY seq DESC LIMIT ?"
            params.append(limit + 1)
            return conn.execute(sql, params).fetchall()

        rows = await self._db.run(page)
        records = [msgspec.json.decode(row["record"], type=FileRecord) for row in rows[:limit]]
        return records, len(rows) > limit

    async def delete_file(self, file_id: str) -> bool:
        """See :meth:`JobStore.delete_file`."""
        cursor = await self._db.run(lambda c: c.execute("DELETE FROM files WHERE id = ?", (file_id,)))
        return cursor.rowcount > 0
