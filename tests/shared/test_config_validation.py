"""Config validation at load: a missing explicit file, errors blamed on the ``SLUICE_*`` variable that caused them,
and numeric values out of range rejected with a message that names the key."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from shared.config import (
    Config,
    ConfigError,
    JobsConfig,
    default_jobs_sqlite_path,
    load_config,
    validate_admission_config,
    with_overrides,
)
from tests.conftest import REPO_ROOT


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ the config file


def test_a_missing_explicit_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value) == f"config file {path} does not exist"


def test_a_missing_file_named_by_sluice_config_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "[gateway]\nmax_n = 3\n")  # the implicit default exists, but SLUICE_CONFIG wins
    with pytest.raises(ConfigError) as info:
        load_config(environ={"SLUICE_CONFIG": "/nonexistent/sluice.toml"})
    assert str(info.value) == "config file /nonexistent/sluice.toml does not exist"


def test_a_missing_implicit_default_file_means_the_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    defaults = msgspec.structs.replace(Config(), jobs=JobsConfig(sqlite_path=default_jobs_sqlite_path(tmp_path)))
    assert load_config(environ={}) == defaults  # the jobs database in var/ of the working directory
    assert load_config(environ={"SLUICE_CONFIG": ""}) == defaults  # empty = unset


def test_the_implicit_default_file_is_read_when_present(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "[gateway]\nmax_n = 3\n")
    assert load_config(environ={}).gateway.max_n == 3


def test_a_directory_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=f"^{tmp_path}: "):
        load_config(tmp_path, environ={})


# --------------------------------------------------------------------------------------- SLUICE_* overrides


@pytest.mark.parametrize("name, text, message", [
    ("SLUICE_GATEWAY__PORT", "abc", "SLUICE_GATEWAY__PORT=abc: Expected `int`, got `str` - at `$.gateway.port`"),
    ("SLUICE_GATEWAY__PROT", "1",
     "SLUICE_GATEWAY__PROT=1: Object contains unknown field `prot` - at `$.gateway`; did you mean `port`?"),
    ("SLUICE_GATEWAY__MAX_N", "0", "SLUICE_GATEWAY__MAX_N=0: Expected `int` >= 1 - at `$.gateway.max_n`"),
    ("SLUICE_NOPE__PORT", "1", "SLUICE_NOPE__PORT=1: Object contains unknown field `nope`"),
    ("SLUICE_TIERS__NAME", "x", "SLUICE_TIERS__NAME=x: tiers is not a table, so it has no key name"),
    ("SLUICE_KV__RETENTION__NORMAL__TTL_SCALE", "2", "SLUICE_KV__RETENTION__NORMAL__TTL_SCALE=2: Expected `float` "
     "<= 1.0 - at `$.kv.retention.normal.ttl_scale`"),
    ("SLUICE_GATEWAY__PORT__X", "1", "SLUICE_GATEWAY__PORT__X=1: gateway.port is not a table, so it has no key x"),
])
def test_an_override_error_names_the_variable(tmp_path, name, text, message):
    path = write(tmp_path, '[gateway]\nport = 8001\n[[tiers]]\nname = "standard"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"SLUICE_WORKER__KV_CACHE_GIB": "1.5", name: text})
    assert str(info.value) == message


def test_an_error_in_the_file_is_blamed_on_the_file_even_with_overrides(tmp_path):
    path = write(tmp_path, "[worker]\nkv_cache_gib = -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"SLUICE_GATEWAY__PORT": "8001"})
    assert str(info.value) == f"{path}:2: Expected `float` > 0.0 - at `$.worker.kv_cache_gib`"


def test_an_override_reaches_a_key_of_a_nested_table_and_keeps_its_siblings(tmp_path):
    path = write(tmp_path, "[kv.retention.normal]\nmax_ttl_s = 120.0\n")
    config = load_config(path, environ={"SLUICE_KV__RETENTION__NORMAL__TTL_SCALE": "0.5"})
    assert (config.kv.retention.normal.ttl_scale, config.kv.retention.normal.max_ttl_s) == (0.5, 120.0)


def test_an_override_may_replace_a_bad_value_of_the_file(tmp_path):
    path = write(tmp_path, '[gateway]\nport = "abc"\n')
    config = load_config(path, environ={"SLUICE_GATEWAY__PORT": "8001", "SLUICE_WORKER__BACKEND": "sim"})
    assert (config.gateway.port, config.worker.backend) == (8001, "sim")


# ------------------------------------------------------------------------------------------------ value ranges


@pytest.mark.parametrize("text, message", [
    ("[worker]\nkv_cache_gib = -1", "Expected `float` > 0.0 - at `$.worker.kv_cache_gib`"),
    ("[worker]\nblock_size_tokens = 0", "Expected `int` >= 1 - at `$.worker.block_size_tokens`"),
    ("[worker]\nnum_local_workers = -1", "Expected `int` >= 0 - at `$.worker.num_local_workers`"),
    ("[gateway]\nmax_n = 0", "Expected `int` >= 1 - at `$.gateway.max_n`"),
    ("[gateway]\nstall_timeout_s = -5.0", "Expected `float` > 0.0 - at `$.gateway.stall_timeout_s`"),
    ("[gateway]\nfirst_token_timeout_s = 0", "Expected `float` > 0.0 - at `$.gateway.first_token_timeout_s`"),
    ("[gateway]\nport = 70000", "Expected `int` <= 65535 - at `$.gateway.port`"),
    ("[kv]\nredis_timeout_s = -0.5", "Expected `float` > 0.0 - at `$.kv.redis_timeout_s`"),
    ("[kv]\nmax_cache_ttl_s_by_tier = { free = -1.0 }",
     "Expected `float` >= 0.0 - at `$.kv.max_cache_ttl_s_by_tier[...]`"),
    ("[kv.retention.elevated]\nttl_scale = 1.5", "Expected `float` <= 1.0 - at `$.kv.retention.elevated.ttl_scale`"),
    ("[sim]\nhbm_efficiency = 0", "Expected `float` > 0.0 - at `$.sim.hbm_efficiency`"),
    ('[[tiers]]\nname = "a"\nqueue_capacity = 0', "Expected `int` >= 1 - at `$.tiers[0].queue_capacity`"),
    ('[[tiers]]\nname = "a"\nreserved_kv_fraction = 1.5',
     "Expected `float` <= 1.0 - at `$.tiers[0].reserved_kv_fraction`"),
    ('[[api_keys]]\nkey = "k"\ntenant = "t"\ntier = "vip"\nrpm_limit = -1',
     "Expected `int` >= 0 - at `$.api_keys[0].rpm_limit`"),
    ("[pressure.critical]\nenter_queue_wait_s = 8.0\nleave_queue_wait_s = 4.0\nenter_kv_used_fraction = 0.9\n"
     "leave_kv_used_fraction = 0.8\nmax_tokens_by_tier = { vip = 0 }",
     "Expected `int` >= 1 - at `$.pressure.critical.max_tokens_by_tier[...]`"),
    ("[breaker]\nfailure_threshold = 0", "Expected `int` >= 1 - at `$.breaker.failure_threshold`"),
    ("[autoscale]\ntarget_utilisation = 1.5", "Expected `float` <= 1.0 - at `$.autoscale.target_utilisation`"),
    ('[[pools]]\nname = "p"\nmin_workers = -1', "Expected `int` >= 0 - at `$.pools[0].min_workers`"),
    ("[registry]\nheartbeat_interval_s = 0", "Expected `float` > 0.0 - at `$.registry.heartbeat_interval_s`"),
    ("[jobs]\nmax_attempts = 0", "Expected `int` >= 1 - at `$.jobs.max_attempts`"),
    ("[jobs]\nlease_timeout_s = nan", "Expected `float` > 0.0 - at `$.jobs.lease_timeout_s`"),
])
def test_a_value_out_of_range_is_an_error_naming_the_key(tmp_path, text, message):
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value) == f"{path}:{text.count(chr(10)) + 1}: {message}"  # the key is on the text's last line


def test_cli_overrides_are_range_checked_too():
    with pytest.raises(ConfigError) as info:
        with_overrides(Config(), worker={"num_local_workers": -1})
    assert str(info.value) == "Expected `int` >= 0 - at `$.worker.num_local_workers`"


def test_boundary_values_with_a_meaning_still_load(tmp_path):
    path = write(tmp_path, """
[gateway]
port = 65535
max_stop_sequences = 0          # no stop strings allowed
worker_restart_backoff_s = 0.0
drain_timeout_s = 0.0           # stop at once on SIGTERM

[worker]
num_local_workers = 0           # remote workers only
num_threads = 0                 # torch's default

[kv]
default_cache_ttl_s = 0.0       # no expiry
max_cache_ttl_s = 0.0
host_cache_gib = 0.0            # tier off
disk_cache_gib = 0.0
redis_cache_gib = 0.0
swap_space_gib = 0.0            # always recompute
redis_retry_s = 0.0

[kv.retention.critical]
ttl_scale = 0.0
max_ttl_s = inf
min_retained_tier_priority = -5

[sim]
hbm_efficiency = 1.0
step_overhead_ms = 0.0

[[tiers]]
name = "only"
priority = -3
reserved_kv_fraction = 0.0
rpm_limit = 0                   # unlimited
tpm_limit = 0

[[api_keys]]
key = "k"
tenant = "t"
tier = "only"
rpm_limit = 0

[admission]
aging_rate_per_s = 0.0
worker_prefill_queue_s = 0.0    # no limit

[pressure]
min_dwell_s = 0.0

[pressure.elevated]
enter_queue_wait_s = 0.0
leave_queue_wait_s = 0.0
enter_kv_used_fraction = 2.0    # never on KV usage
leave_kv_used_fraction = 2.0

[breaker]
cooldown_s = 0.0

[[pools]]
name = "remote"
min_workers = 0
max_workers = 0                 # remote workers only
cost_per_worker_s = 0.0
scale_up_after_s = 0.0
scale_down_after_s = 0.0

[autoscale]
scale_down_utilisation = 1.0
target_utilisation = 1.0
initial_cold_start_s = 0.0
demand_window_s = 0.0           # no load-proportional scaling

[jobs]
idle_grace_s = 0.0
""")
    config = load_config(path, environ={})
    assert (config.gateway.port, config.gateway.max_stop_sequences, config.gateway.drain_timeout_s) == (65535, 0, 0.0)
    assert (config.worker.num_local_workers, config.kv.host_cache_gib, config.kv.swap_space_gib) == (0, 0.0, 0.0)
    assert math.isinf(config.kv.retention.critical.max_ttl_s) and config.kv.retention.critical.ttl_scale == 0.0
    assert (config.tiers[0].priority, config.api_keys[0].rpm_limit) == (-3, 0)
    assert config.pressure.elevated.enter_kv_used_fraction == 2.0
    assert (config.pools[0].max_workers, config.autoscale.target_utilisation) == (0, 1.0)


def test_the_defaults_and_the_shipped_config_are_valid():
    assert msgspec.convert(msgspec.to_builtins(Config()), Config) == Config()
    shipped = load_config(REPO_ROOT / "config.toml", environ={})
    assert (shipped.gateway.max_n, shipped.worker.kv_cache_gib) == (8, 0.5)


# ------------------------------------------------------------------------------------------------ sluice serve


def test_serve_with_an_out_of_range_value_exits_2_before_starting_anything(tmp_path):
    path = write(tmp_path, "[gateway]\nmax_n = 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    # port 1 cannot be bound: should the check ever be missed, the gateway fails fast instead of serving
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", "--config", str(path), "--port", "1"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"sluice serve: {path}:2: Expected `int` >= 1 - at `$.gateway.max_n`\n"
    assert "gateway_listening" not in result.stdout


def test_an_override_that_may_hold_a_secret_is_named_without_its_value(tmp_path):
    empty = tmp_path / "config.toml"
    empty.write_text("")
    with pytest.raises(ConfigError) as info:
        load_config(empty, environ={"SLUICE_REGISTRY__REDIS_URL": "42"})  # a number where a URL string goes
    assert str(info.value) == ("SLUICE_REGISTRY__REDIS_URL=<redacted>: Expected `str`, got `int` - at "
                               "`$.registry.redis_url`")


# ------------------------------------------------------------------------------------------------ named choices


def test_config_names_exactly_the_eviction_policies_the_worker_has():
    import typing

    from shared.config import EvictionPolicyName
    from worker.kv_cache.eviction import policy_names

    assert sorted(typing.get_args(EvictionPolicyName)) == policy_names()


def test_config_names_exactly_the_dispatch_orders_admission_has():
    from gateway.admission.order import FifoOrder, PriorityAgingOrder
    from shared.config import AdmissionConfig

    field = {f.name: f for f in msgspec.inspect.type_info(AdmissionConfig).fields}["order_policy"]
    assert sorted(field.type.values) == sorted([PriorityAgingOrder.name, FifoOrder.name])


@pytest.mark.parametrize("text, key", [
    ('[kv]\neviction_policy = "lruu"\n', "eviction_policy"),
    ('[kv.retention.elevated]\neviction_policy = "lfuu"\n', "eviction_policy"),
    ('[admission]\norder_policy = "fifoo"\n', "order_policy"),
])
def test_a_misspelt_policy_fails_at_load_naming_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ={})
    assert key in str(info.value) and "config.toml:2" in str(info.value)


def test_a_pressure_level_table_may_leave_out_thresholds(tmp_path):
    """Every key is optional (README, Configuration): a ``[pressure.critical]`` table that sets only what it changes
    keeps the level's defaults for the rest (README trial 4: ``missing required field enter_kv_used_fraction``)."""
    path = tmp_path / "config.toml"
    path.write_text('[pressure.critical]\nenter_queue_wait_s = 6.0\nleave_queue_wait_s = 3.0\n'
                    'shed_tiers = ["free", "batch"]\n')
    critical = load_config(path, environ={}).pressure.critical
    default = Config().pressure.critical
    assert (critical.enter_queue_wait_s, critical.leave_queue_wait_s) == (6.0, 3.0)
    assert (critical.enter_kv_used_fraction, critical.leave_kv_used_fraction) == (
        default.enter_kv_used_fraction, default.leave_kv_used_fraction)
    assert critical.shed_tiers == ["free", "batch"]
    assert critical.max_tokens_by_tier == default.max_tokens_by_tier  # the level's, not the field's empty default
    elevated = load_config(path, environ={"SLUICE_PRESSURE__ELEVATED__ENTER_QUEUE_WAIT_S": "3.5"}).pressure.elevated
    assert elevated.enter_queue_wait_s == 3.5
    assert elevated.enter_kv_used_fraction == Config().pressure.elevated.enter_kv_used_fraction


# ------------------------------------------------------------------------------------------------ tier names


@pytest.mark.parametrize("text, key", [
    ("[kv]\nmax_cache_ttl_s_by_tier = { gold = 5.0 }\n", "kv.max_cache_ttl_s_by_tier"),
    ("[pressure.elevated]\nmax_tokens_by_tier = { gold = 5 }\n", "pressure.elevated.max_tokens_by_tier"),
    ("[pressure.critical]\nqueue_timeout_s_by_tier = { gold = 5.0 }\n", "pressure.critical.queue_timeout_s_by_tier"),
    ('[pressure.critical]\nshed_tiers = ["gold"]\n', "pressure.critical.shed_tiers"),
])
def test_every_by_tier_map_rejects_a_name_that_is_no_tier(tmp_path, text, key):
    config = load_config(write(tmp_path, text), environ={})
    with pytest.raises(ConfigError) as info:
        validate_admission_config(config)
    assert str(info.value) == f"{key}: unknown tiers ['gold']; tiers are ['vip', 'standard', 'free', 'batch']"


def test_a_by_tier_map_may_name_custom_tiers(tmp_path):
    config = load_config(write(tmp_path, 'default_tier = "gold"\n\n[[tiers]]\nname = "gold"\n\n'
                                         "[kv]\nmax_cache_ttl_s_by_tier = { gold = 5.0 }\n"), environ={})
    validate_admission_config(config)  # and the default pressure levels, which name the default tiers, pass too
    assert config.kv.max_cache_ttl_s_by_tier == {"gold": 5.0}


@pytest.mark.parametrize("table", [
    "[pressure.critical]\nshed_tiers = []\n",
    "[pressure.elevated]\nqueue_timeout_s_by_tier = {}\n",
    "[pressure.elevated]\nenter_queue_wait_s = 3.0\n",
])
def test_a_pressure_table_that_sets_one_key_passes_with_custom_tiers(tmp_path, table):
    # the keys it leaves out take the level's defaults, which name the default tiers: they are not the config's
    config = load_config(write(tmp_path, 'default_tier = "gold"\n\n[[tiers]]\nname = "gold"\n\n' + table), environ={})
    validate_admission_config(config)


def test_a_pressure_table_naming_a_tier_the_custom_tiers_lack_is_refused(tmp_path):
    config = load_config(write(tmp_path, 'default_tier = "gold"\n\n[[tiers]]\nname = "gold"\n\n'
                                         '[pressure.critical]\nshed_tiers = ["free"]\n'), environ={})
    with pytest.raises(ConfigError) as info:
        validate_admission_config(config)
    assert str(info.value) == "pressure.critical.shed_tiers: unknown tiers ['free']; tiers are ['gold']"


# ---------------------------------------------------------------------------- sluice serve: checks at start


BROKEN_AT_START = [  # (config, other files beside it, the start of the one-line message, which names the key)
    pytest.param('[[api_keys]]\nkey = "k"\ntenant = "x"\ntier = "vip"\n\n[[api_keys]]\nkey = "k"\ntenant = "y"\n'
                 'tier = "free"\n', {}, "api_keys[1].key: the key of tenant 'y' is listed twice (also api_keys[0])",
                 id="duplicate-key"),
    pytest.param('[admission]\nkeys_file = "/nonexistent/keys.toml"\n', {},
                 "admission.keys_file /nonexistent/keys.toml: ", id="missing-keys-file"),
    pytest.param('[admission]\nkeys_file = "keys.toml"\n',
                 {"keys.toml": '[[api_keys]]\nkey = "k"\ntenant = "t"\ntier = "gold"\n'},
                 "admission.keys_file keys.toml: api_keys[0].tier: 'gold' (tenant 't') is not a tier",
                 id="unknown-tier-in-keys-file"),
    pytest.param('[[pools]]\nname = "u"\nbackend = "openai"\nupstreams = ["http://127.0.0.1:9"]\n'
                 'api_key_env = "DEFINITELY_NOT_SET_XYZ"\n', {},
                 "pools[u].api_key_env: the variable DEFINITELY_NOT_SET_XYZ is not set", id="unset-api-key-env"),
    pytest.param('[model]\npath = "/nonexistent/model.gguf"\n', {},
                 "model.path: '/nonexistent/model.gguf' does not exist", id="missing-model-path"),
    pytest.param("[kv]\nmax_cache_ttl_s_by_tier = { gold = 5.0 }\n", {},
                 "kv.max_cache_ttl_s_by_tier: unknown tiers ['gold']", id="kv-ttl-unknown-tier"),
]


@pytest.mark.parametrize("text, files, message", BROKEN_AT_START)
def test_serve_refuses_what_only_start_checks_in_one_line_exit_2(tmp_path, text, files, message):
    """Keys, the keys file, upstream tokens, model paths and tier names: ``serve`` stops with one line naming the key
    (before, a 28-line traceback), before it binds its port or loads a model."""
    for name, content in files.items():
        write(tmp_path, content, name)
    path = write(tmp_path, text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") and k != "DEFINITELY_NOT_SET_XYZ"}
    # port 1 cannot be bound: should the check ever be missed, the gateway fails fast instead of serving
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", "--config", str(path), "--port", "1"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"sluice serve: {message}") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and "gateway_listening" not in result.stdout
