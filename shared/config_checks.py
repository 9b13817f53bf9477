"""Checks of a decoded config that read files and the environment but need no worker and no network.

``sluice serve`` runs :func:`check_config` before it binds its port or spawns a worker, and ``sluice config
--check`` runs the same function, so a config the check passes is not then refused by ``serve``. The gateway's
parts call the pieces they need (:func:`load_api_keys`, :func:`index_api_keys`, :func:`upstream_api_key`) when
they start, with the same messages.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

import msgspec

from shared.auth import load_secret
from shared.config import (
    ApiKeyConfig,
    Config,
    ConfigError,
    PoolConfig,
    check_kv_disk_cache_dir,
    check_local_model_path,
    effective_pools,
    effective_tiers,
    tokenizer_model_path,
    validate_admission_config,
    validate_pool_config,
)


#: Pool backends whose local workers load a model and so build the KV offload tiers (``sim`` has no KV tensor).
LOCAL_MODEL_BACKENDS = ("auto", "cpu", "cuda")


class _KeysFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    api_keys: list[ApiKeyConfig] = []


def load_api_keys(config: Config) -> list[ApiKeyConfig]:
    """Return ``config.api_keys`` plus the keys of ``admission.keys_file`` (read once, at start).

    Raises:
        ConfigError: the keys file is missing, not TOML, or has an unknown key; the message names it.
    """
    keys = list(config.api_keys)
    path_str = config.admission.keys_file
    if not path_str:
        return keys
    path = Path(path_str)
    try:
        raw = tomllib.loads(path.read_text())
        keys.extend(msgspec.convert(raw, _KeysFile).api_keys)
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"admission.keys_file {path}: {exc}") from exc
    return keys


def _api_key_label(config: Config, index: int) -> str:
    """Name the ``index``-th key of :func:`load_api_keys`: ``api_keys[i]`` of the config, or of the keys file."""
    num_config_keys = len(config.api_keys)
    if index < num_config_keys:
        return f"api_keys[{index}]"
    return f"admission.keys_file {config.admission.keys_file}: api_keys[{index - num_config_keys}]"


def index_api_keys(config: Config, keys: list[ApiKeyConfig]) -> dict[str, ApiKeyConfig]:
    """Return ``keys`` (as :func:`load_api_keys` returns them) by their secret.

    Raises:
        ConfigError: a key names a tier that does not exist, or the same secret is listed twice; the message names
            the entry (``api_keys[1].key`` or ``admission.keys_file keys.toml: api_keys[0].tier``), never the secret.
    """
    names = [tier.name for tier in effective_tiers(config)]
    by_key: dict[str, ApiKeyConfig] = {}
    first_index: dict[str, int] = {}
    for i, entry in enumerate(keys):
        if entry.tier not in names:
            raise ConfigError(f"{_api_key_label(config, i)}.tier: {entry.tier!r} (tenant {entry.tenant!r}) is not "
                              f"a tier; tiers are {names}")
        if entry.key in by_key:
            raise ConfigError(f"{_api_key_label(config, i)}.key: the key of tenant {entry.tenant!r} is listed twice "
                              f"(also {_api_key_label(config, first_index[entry.key])})")
        by_key[entry.key] = entry
        first_index[entry.key] = i
    return by_key


def upstream_api_key(pool: PoolConfig, environ: Mapping[str, str] | None = None) -> str:
    """Return the bearer token for the pool's upstreams: ``api_key``, else the variable ``api_key_env`` names.

    Args:
        pool: a ``backend = "openai"`` pool.
        environ: where to read ``api_key_env`` (default ``os.environ``).

    Raises:
        ConfigError: ``api_key_env`` names a variable that is not set.
    """
    if pool.api_key or not pool.api_key_env:
        return pool.api_key
    value = (os.environ if environ is None else environ).get(pool.api_key_env)
    if value is None:
        raise ConfigError(f"pools[{pool.name}].api_key_env: the variable {pool.api_key_env} is not set")
    return value


def check_config(config: Config, environ: Mapping[str, str] | None = None) -> None:
    """Run every check ``sluice serve`` makes at start that needs no worker and no network.

    Tiers, keys and pressure levels (:func:`~shared.config.validate_admission_config`); pools, autoscaler, registry
    (:func:`~shared.config.validate_pool_config`); the worker secret (:func:`~shared.auth.load_secret`); the API
    keys with ``admission.keys_file`` (:func:`load_api_keys`, :func:`index_api_keys`); the variables the
    ``api_key_env`` of upstream pools name; model and tokenizer paths that look local (they must exist) and the
    default model when one is needed (it must be installed); ``kv.disk_cache_dir`` when a pool starts local model
    workers (:func:`~shared.config.check_kv_disk_cache_dir`: they make their disk tier's folder in it).

    Args:
        config: the decoded config.
        environ: where to read ``api_key_env`` variables (default ``os.environ``).

    Raises:
        ConfigError: the first failing check; the message names the key.
    """
    validate_admission_config(config)
    validate_pool_config(config)
    load_secret(config.worker)
    index_api_keys(config, load_api_keys(config))
    for pool in config.pools:
        if pool.backend == "openai":
            upstream_api_key(pool, environ)
    for i, pool in enumerate(config.pools):
        check_local_model_path(pool.model, f"pools[{i}].model")
        check_local_model_path(pool.tokenizer, f"pools[{i}].tokenizer")
    if any(pool.backend in LOCAL_MODEL_BACKENDS and pool.max_workers > 0 for pool in effective_pools(config)):
        check_kv_disk_cache_dir(config.kv)
    if not config.model.synthetic:
        check_local_model_path(config.model.path, "model.path")
        tokenizer_model_path(config)  # the gateway's tokenizer: the default model when nothing else is named
