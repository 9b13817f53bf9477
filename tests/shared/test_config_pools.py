"""Pools, autoscaler, registry and rate-limit config (issue 7): defaults derived from ``[worker]``, fills from
``[model]``, and validation errors that name the key."""

from __future__ import annotations

import re

import msgspec
import pytest

from shared.config import (
    DEFAULT_POOL_NAME,
    Config,
    ConfigError,
    effective_pools,
    load_config,
    validate_pool_config,
    with_overrides,
)


def write(tmp_path, text: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_without_pools_one_fixed_default_pool_keeps_the_old_behaviour(tmp_path):
    config = load_config(write(tmp_path, '[model]\nname = "m"\n[worker]\nnum_local_workers = 3\nbackend = "sim"\n'),
                         environ={})
    [pool] = effective_pools(config)
    assert (pool.name, pool.model_name, pool.backend) == (DEFAULT_POOL_NAME, "m", "sim")
    assert (pool.min_workers, pool.max_workers) == (3, 3)
    validate_pool_config(config)
    assert config.registry.redis_url == "" and config.ratelimit.backend == "local"
    assert config.autoscale.enabled


def test_pools_fill_model_and_name_from_the_model_section(tmp_path):
    config = load_config(write(tmp_path, """
[model]
name = "big"
path = "/models/big.gguf"

[[pools]]
name = "h200"
backend = "cuda"
devices = ["0", "1"]
min_workers = 0
max_workers = 2
cost_per_worker_s = 1.0

[[pools]]
name = "light"
model = "/models/small.gguf"
model_name = "small"
backend = "sim"
env = { SLUICE_SIM__MODEL_PARAMS_B = "1.7" }

[[tiers]]
name = "free"
degrade_pool = "light"
degrade_at = "elevated"
"""), environ={})
    big, light = effective_pools(config)
    assert (big.model, big.model_name, big.devices) == ("/models/big.gguf", "big", ["0", "1"])
    assert (light.model, light.model_name, light.env) == ("/models/small.gguf", "small",
                                                          {"SLUICE_SIM__MODEL_PARAMS_B": "1.7"})
    assert (config.tiers[0].degrade_pool, config.tiers[0].degrade_at) == ("light", "elevated")
    validate_pool_config(config)


@pytest.mark.parametrize("pools, tiers, message", [
    ([{"name": "a"}, {"name": "a"}], None, "duplicate pool names"),
    ([{"name": "a", "min_workers": 3, "max_workers": 2}], None, "pools[0]: need 0 ≤ min_workers"),
    ([{"name": "a", "backend": "cuda", "devices": ["0"], "max_workers": 2}], None, "pools[0].max_workers"),
    ([{"name": "a", "target_queue_wait_s": 0}], None, "pools[0].target_queue_wait_s"),
    ([{"name": "a", "env": {"NOT A NAME": "1"}}], None, "pools[0].env"),
    ([{"name": "a"}], [{"name": "free", "degrade_pool": "nope"}], "tiers[0].degrade_pool"),
    ([{"name": "u", "backend": "openai", "upstreams": ["ftp://h:1"]}], None, "pools[0].upstreams[0]: 'ftp://h:1' is"),
    # the docs say "without /v1"; with it, Sluice polled /v1/v1/models
    ([{"name": "u", "backend": "openai", "upstreams": ["http://h:1", "http://127.0.0.1:19180/v1"]}], None,
     "pools[0].upstreams[1]: 'http://127.0.0.1:19180/v1' ends in /v1: give the server's base URL without it "
     "('http://127.0.0.1:19180')"),
    ([{"name": "u", "backend": "openai", "upstreams": ["https://h/v1/"]}], None, "pools[0].upstreams[0]: "
     "'https://h/v1/' ends in /v1"),
])
def test_invalid_pools_name_the_key(pools, tiers, message):
    sections = {"pools": pools}
    if tiers is not None:
        sections.update(tiers=tiers, default_tier="free")
    config = msgspec.convert(sections, Config)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_pool_config(config)


def test_registry_and_ratelimit_settings_are_checked():
    base = Config()
    with pytest.raises(ConfigError, match="heartbeat_interval_s < heartbeat_ttl_s"):
        validate_pool_config(with_overrides(base, registry={"heartbeat_interval_s": 2.0, "heartbeat_ttl_s": 1.0}))
    with pytest.raises(ConfigError, match="ratelimit.redis_url"):
        validate_pool_config(with_overrides(base, ratelimit={"backend": "redis"}))
    validate_pool_config(with_overrides(base, ratelimit={"backend": "redis"},
                                        registry={"redis_url": "redis://127.0.0.1:6379/0"}))
    with pytest.raises(msgspec.ValidationError, match="degrade_at"):
        msgspec.convert({"tiers": [{"name": "x", "degrade_at": "normal"}]}, Config)


def test_env_overrides_reach_the_new_sections(tmp_path):
    empty = tmp_path / "config.toml"
    empty.write_text("")
    config = load_config(empty, environ={"SLUICE_REGISTRY__REDIS_URL": "redis://h:1/0",
                                         "SLUICE_AUTOSCALE__ENABLED": "false"})
    assert config.registry.redis_url == "redis://h:1/0" and not config.autoscale.enabled
