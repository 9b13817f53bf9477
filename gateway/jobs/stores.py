"""Make the job store that ``[jobs] store`` names: SQLite (the default) or Redis; and what a store that cannot be
reached raises."""

from __future__ import annotations

import redis.exceptions

from gateway.jobs.redis_store import RedisJobStore
from gateway.jobs.sqlite_store import SqliteJobStore
from gateway.jobs.store import JobStore
from shared.config import JobsConfig, default_jobs_sqlite_path


# A store that cannot be reached for now (Redis stopped, restarting or unreachable): 503, not a bug.
STORE_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.ConnectionError,
                                                             redis.exceptions.TimeoutError)


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
