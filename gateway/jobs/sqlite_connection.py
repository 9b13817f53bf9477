"""The SQLite job store's connection: one database file in WAL mode, used from one dedicated thread.

``sqlite3`` is blocking, so every call runs on a single-thread executor that owns the connection; the event loop
never waits on it. Multi-statement changes run inside ``BEGIN IMMEDIATE`` transactions, so several processes may
share the file (SQLite's own locking; ``busy_timeout`` waits for the lock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
from pathlib import Path
from typing import Callable, TypeVar

from gateway.jobs.sqlite_schema import SCHEMA

T = TypeVar("T")

BUSY_TIMEOUT_MS = 10000


class SqliteConnection:
    """One connection to the job store's database file and the thread it runs on.

    Args:
        path: the database file (created with its tables when missing).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        """Start the thread, open the file in WAL mode and create the tables."""
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-jobs-db")

        def connect() -> sqlite3.Connection:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across process crashes
            conn.executescript(SCHEMA)
            return conn

        self._conn = await asyncio.get_running_loop().run_in_executor(self._executor, connect)

    async def close(self) -> None:
        """Close the connection and stop the thread."""
        if self._executor is None:
            return
        conn, self._conn = self._conn, None
        if conn is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, conn.close)
        self._executor.shutdown(wait=True)
        self._executor = None

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Return ``fn(connection)``, called on the connection's thread (autocommit: each statement on its own).

        Raises:
            RuntimeError: the connection is not open.
        """
        if self._executor is None or self._conn is None:
            raise RuntimeError("the SQLite job store is not open")
        conn = self._conn
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, conn)

    async def tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Return ``fn(connection)``, called on the connection's thread inside one ``BEGIN IMMEDIATE`` transaction
        (rolled back when ``fn`` raises)."""
        return await self.run(lambda conn: self._transaction(conn, fn))

    @staticmethod
    def _transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result
