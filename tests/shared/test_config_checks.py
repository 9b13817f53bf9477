"""The checks ``sluice serve`` and ``sluice config --check`` run at start (shared/config_checks.py)."""

from __future__ import annotations

import os
import re

import msgspec
import pytest

from shared.config import (
    AdmissionConfig,
    ApiKeyConfig,
    Config,
    ConfigError,
    KVConfig,
    ModelConfig,
    PoolConfig,
    WorkerConfig,
    looks_like_local_path,
    resolve_model_path,
)
from shared.config_checks import check_config, index_api_keys, load_api_keys, upstream_api_key


@pytest.mark.parametrize("path, local", [
    ("/models/m.gguf", True),
    ("./m", True),
    ("../models/m", True),
    ("~/m", True),
    ("models/m.gguf", True),  # the loaders read GGUF files from disk only
    ("models/smollm/base", True),  # a hub id has at most one "/"
    ("HuggingFaceTB/SmolLM2-135M-Instruct", False),
    ("gpt2", False),
])
def test_a_path_looks_local_unless_it_may_be_a_hub_id(path, local):
    assert looks_like_local_path(path) is local


def test_a_missing_local_model_path_names_the_key_and_a_hub_id_passes(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^model.path: '/nonexistent/m.gguf' does not exist$"):
        resolve_model_path(ModelConfig(path="/nonexistent/m.gguf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"relative to the working directory {tmp_path}"):
        resolve_model_path(ModelConfig(path="./m.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(ModelConfig(path="./m.gguf")) == "./m.gguf"
    assert resolve_model_path(ModelConfig(path="org/name")) == "org/name"


def test_check_config_names_the_pool_field_of_a_missing_path_and_skips_a_synthetic_models_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^pools\[1\].tokenizer: "):
        check_config(Config(pools=[PoolConfig(name="a", backend="sim"),
                                   PoolConfig(name="b", backend="sim", tokenizer=str(tmp_path / "nope"))]))
    check_config(Config(model=ModelConfig(path="/nonexistent/m.gguf", synthetic="llama-3-tiny")))


def test_a_key_listed_in_the_config_and_in_the_keys_file_names_both(tmp_path):
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[[api_keys]]\nkey = "other"\ntenant = "o"\ntier = "free"\n\n'
                         '[[api_keys]]\nkey = "sk-1"\ntenant = "b"\ntier = "free"\n')
    config = Config(admission=AdmissionConfig(keys_file=str(keys_file)),
                    api_keys=[ApiKeyConfig(key="sk-1", tenant="a", tier="vip")])
    with pytest.raises(ConfigError) as info:
        index_api_keys(config, load_api_keys(config))
    assert str(info.value) == (f"admission.keys_file {keys_file}: api_keys[1].key: the key of tenant 'b' is listed "
                               f"twice (also api_keys[0])")
    assert "sk-1" not in str(info.value)  # the secret stays out of logs


def test_upstream_api_key_reads_the_variable_it_names():
    pool = PoolConfig(name="u", backend="openai", upstreams=["http://h"], api_key_env="TOKEN")
    assert upstream_api_key(pool, {"TOKEN": "t"}) == "t"
    with pytest.raises(ConfigError, match=r"^pools\[u\].api_key_env: the variable TOKEN is not set$"):
        upstream_api_key(pool, {})
    with pytest.raises(ConfigError, match="TOKEN is not set"):
        check_config(Config(pools=[pool]), environ={})
    check_config(Config(pools=[pool]), environ={"TOKEN": "t"})


def test_check_config_refuses_a_disk_cache_dir_the_worker_cannot_make_its_folder_in(tmp_path, monkeypatch):
    """The user trial: ``kv.disk_cache_dir = "/etc/passwd/sub"`` passed ``config --check``; every worker then died
    making its disk tier's folder and was restarted for ever."""
    (tmp_path / "file").write_text("")
    synthetic = ModelConfig(synthetic="llama-3-tiny")
    with pytest.raises(ConfigError, match=rf"^kv.disk_cache_dir: '{tmp_path}/file/sub': {tmp_path}/file is not a "
                                          r"directory; "):
        check_config(Config(model=synthetic, kv=KVConfig(disk_cache_dir=f"{tmp_path}/file/sub")))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"relative to the working directory {tmp_path}"):
        check_config(Config(model=synthetic, kv=KVConfig(disk_cache_dir="file/sub")))
    check_config(Config(model=synthetic, kv=KVConfig(disk_cache_dir=f"{tmp_path}/new/deeper")))  # the worker makes it
    check_config(Config(model=synthetic, kv=KVConfig(disk_cache_dir=str(tmp_path))))
    check_config(Config(model=synthetic, kv=KVConfig(disk_cache_dir="file/sub", disk_cache_gib=0)))  # no disk tier
    sim_only = Config(model=synthetic, worker=WorkerConfig(backend="sim"), kv=KVConfig(disk_cache_dir="file/sub"))
    check_config(sim_only)  # the simulator keeps no KV on disk


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_check_config_refuses_a_disk_cache_dir_that_is_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=rf"^kv.disk_cache_dir: '{locked}/kv': {locked} is not writable"):
        check_config(Config(model=ModelConfig(synthetic="llama-3-tiny"), kv=KVConfig(disk_cache_dir=f"{locked}/kv")))


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:6379/9", "'http://127.0.0.1:6379/9' is not a redis://, rediss:// or unix:// URL"),
    ("127.0.0.1:6379", "'127.0.0.1:6379' is not a redis://, rediss:// or unix:// URL"),
    ("redis://127.0.0.1:abc/0", "'redis://127.0.0.1:abc/0': Port could not be cast to integer value as 'abc'"),
])
def test_check_config_refuses_a_kv_redis_url_redis_cannot_take(url, message):
    with pytest.raises(ConfigError, match="^kv.redis_url: " + re.escape(message)):
        check_config(Config(model=ModelConfig(synthetic="llama-3-tiny"), kv=KVConfig(redis_url=url)))


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/9", "rediss://cache.example:6380/0", "unix:///tmp/r.sock",
                                 "redis://:secret@127.0.0.1/0", ""])
def test_check_config_takes_every_kv_redis_url_scheme_redis_takes_without_connecting(url):
    check_config(Config(model=ModelConfig(synthetic="llama-3-tiny"), kv=KVConfig(redis_url=url)))


def test_config_check_refuses_the_offload_settings_of_the_user_trial(tmp_path, capsys):
    from sluice.config_cmd import main as config_main

    (tmp_path / "file").write_text("")
    config_path = tmp_path / "bad.toml"
    config_path.write_text('[model]\nsynthetic = "llama-3-tiny"\n[worker]\nkv_cache_gib = 0.03\n'
                           f'[kv]\ndisk_cache_dir = "{tmp_path}/file/sub"\n')
    assert config_main(["--check", "--config", str(config_path)]) == 1
    captured = capsys.readouterr()
    assert f"kv.disk_cache_dir: '{tmp_path}/file/sub'" in captured.out + captured.err
    config_path.write_text('[model]\nsynthetic = "llama-3-tiny"\n[kv]\nredis_url = "http://127.0.0.1:6379/9"\n')
    assert config_main(["--check", "--config", str(config_path)]) == 1
    captured = capsys.readouterr()
    assert "kv.redis_url: 'http://127.0.0.1:6379/9' is not a redis://" in captured.out + captured.err


@pytest.mark.parametrize("section, key", [("registry", "registry.redis_url"), ("ratelimit", "ratelimit.redis_url"),
                                          ("jobs", "jobs.redis_url")])
def test_check_config_refuses_every_redis_url_redis_cannot_take(section, key):
    settings = {"redis_url": "http://127.0.0.1:6379/9"}
    if section == "jobs":
        settings["store"] = "redis"
    config = msgspec.convert({"model": {"synthetic": "llama-3-tiny"}, section: settings}, Config)
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}: 'http://127.0.0.1:6379/9' is not a redis://"):
        check_config(config)
