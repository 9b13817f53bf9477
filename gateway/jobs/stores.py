"""Make the job store that ``[jobs] store`` names: SQLite (the default) or Redis."""

from __future__ import annotations

import os

from gateway.jobs.redis_store import RedisJobStore
from gateway.jobs.sqlite_store import SqliteJobStore
from gateway.jobs.store import JobStore
from shared.config import JobsConfig


def default_sqlite_path() -> str:
    """Return the SQLite file used when ``jobs.sqlite_path`` is empty: ``$XDG_STATE_HOME/sluice/jobs.sqlite3``."""
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state_home, "sluice", "jobs.sqlite3")


def make_store(config: JobsConfig) -> JobStore:
    """Return the store ``config.store`` names (not opened yet).

    Raises:
        ValueError: an unknown store name (the config's ``Literal`` normally prevents it).
    """
    if config.store == "sqlite":
        return SqliteJobStore(config.sqlite_path or default_sqlite_path())
    if config.store == "redis":
        return RedisJobStore(config.redis_url, config.redis_key_prefix)
    raise ValueError(f"jobs.store: unknown store {config.store!r}; valid: sqlite, redis")
