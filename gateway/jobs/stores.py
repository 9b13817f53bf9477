"""Make the job store that ``[jobs] store`` names: SQLite (the default) or Redis; and what a store that cannot be
reached raises."""

from __future__ import annotations

from gateway.jobs.redis_store import RedisJobStore
from gateway.jobs.sqlite_store import SqliteJobStore
from gateway.jobs.store import STORE_UNAVAILABLE_ERRORS, JobStore
from shared.config import JobsConfig, default_jobs_sqlite_path

__all__ = ["STORE_UNAVAILABLE_ERRORS", "make_store"]


def make_store(config: JobsConfig) -> JobStore:
    """Return the store ``config.store`` names (not opened yet).

    Raises:
        ValueError: an unknown store name (the config's ``Literal`` normally prevents it).
    """
    if config.store == "sqlite":
        return SqliteJobStore(config.sqlite_path or default_jobs_sqlite_path())
    if config.store == "redis":
        return RedisJobStore(config.redis_url, config.redis_key_prefix)
    raise ValueError(f"jobs.store: unknown store {config.store!r}; valid: sqlite, redis")
