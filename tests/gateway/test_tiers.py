"""Tiers: API key → tenant and tier, default tier, 401 when keys are required, lowering but never raising."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.pipeline.classify import ANONYMOUS_TENANT, TierResolver, load_api_keys
from shared.config import (
    DEFAULT_TIERS,
    AdmissionConfig,
    ApiKeyConfig,
    Config,
    ConfigError,
    TierConfig,
    effective_tiers,
    load_config,
    validate_admission_config,
    with_overrides,
)
from shared.errors import ErrorCode, SluiceError

KEYS = [
    ApiKeyConfig(key="sk-vip", tenant="acme", tier="vip", rpm_limit=600),
    ApiKeyConfig(key="sk-free", tenant="bob", tier="free"),
]


def resolver(require_api_key: bool = False, keys: list[ApiKeyConfig] = KEYS) -> TierResolver:
    config = Config(admission=AdmissionConfig(require_api_key=require_api_key), api_keys=keys)
    return TierResolver(config)


def test_config_without_tiers_gets_the_four_default_tiers():
    tiers = effective_tiers(Config())
    assert [tier.name for tier in tiers] == ["vip", "standard", "free", "batch"]
    assert [tier.priority for tier in tiers] == sorted((tier.priority for tier in tiers), reverse=True)
    assert Config().default_tier == "standard"


def test_config_toml_declares_the_same_default_tiers():
    config = load_config(Path(__file__).parents[2] / "config.toml", environ={})
    assert tuple(config.tiers) == DEFAULT_TIERS
    validate_admission_config(config)


def test_api_key_maps_to_tenant_and_tier():
    principal = resolver().resolve("Bearer sk-vip")
    assert (principal.tenant, principal.tier.name, principal.rate_limit_key) == ("acme", "vip", "sk-vip")
    assert principal.rpm_limit == 600  # the key's own limit
    free = resolver().resolve("Bearer sk-free")
    assert (free.rpm_limit, free.tpm_limit) == (60, 60000)  # the free tier's limits


def test_no_key_gets_the_default_tier():
    principal = resolver().resolve(None)
    assert principal.tenant == ANONYMOUS_TENANT and principal.tier.name == "standard"
    assert resolver().resolve("Bearer sk-unknown").tier.name == "standard"


@pytest.mark.parametrize("authorization", [None, "", "Bearer sk-unknown", "Basic abc"])
def test_required_key_missing_or_unknown_is_401(authorization):
    with pytest.raises(SluiceError) as info:
        resolver(require_api_key=True).resolve(authorization)
    assert info.value.code is ErrorCode.INVALID_API_KEY and info.value.status == 401


def test_client_can_lower_its_tier_by_body_field_or_header():
    r = resolver()
    assert r.resolve("Bearer sk-vip", body_service_tier="free").tier.name == "free"
    assert r.resolve("Bearer sk-vip", header_tier="batch").tier.name == "batch"
    principal = r.resolve("Bearer sk-vip", header_tier="standard", body_service_tier="free")
    assert principal.tier.name == "free" and principal.key_tier.name == "vip"  # the lower of the two


def test_client_can_never_raise_its_tier():
    r = resolver()
    assert r.resolve("Bearer sk-free", header_tier="vip").tier.name == "free"
    assert r.resolve("Bearer sk-free", body_service_tier="vip").tier.name == "free"
    assert r.resolve(None, header_tier="vip").tier.name == "standard"


def test_openai_service_tier_values_are_understood():
    r = resolver()
    for value in ("auto", "default", "priority", "scale"):
        assert r.resolve("Bearer sk-vip", body_service_tier=value).tier.name == "vip"
    assert r.resolve("Bearer sk-vip", body_service_tier="flex").tier.name == "batch"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"body_service_tier": "platinum"}, "service_tier"),
    ({"header_tier": "platinum"}, "x-sluice-tier"),
])
def test_unknown_tier_name_is_a_400_naming_the_field(kwargs, param):
    with pytest.raises(SluiceError) as info:
        resolver().resolve("Bearer sk-vip", **kwargs)
    assert info.value.code is ErrorCode.INVALID_VALUE and info.value.status == 400
    assert info.value.param == param
    assert "vip" in info.value.message  # lists the valid ones


def test_keys_file_adds_keys(tmp_path: Path):
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[[api_keys]]\nkey = "sk-file"\ntenant = "filed"\ntier = "batch"\ntpm_limit = 10\n')
    config = Config(admission=AdmissionConfig(keys_file=str(keys_file)), api_keys=KEYS)
    assert [key.key for key in load_api_keys(config)] == ["sk-vip", "sk-free", "sk-file"]
    principal = TierResolver(config).resolve("Bearer sk-file")
    assert (principal.tenant, principal.tier.name, principal.tpm_limit) == ("filed", "batch", 10)


def test_bad_keys_file_is_a_config_error_naming_it(tmp_path: Path):
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[[api_keys]]\nkey = "k"\ntenant = "t"\ntier = "vip"\nrpm = 1\n')
    with pytest.raises(ConfigError, match="keys.toml"):
        load_api_keys(Config(admission=AdmissionConfig(keys_file=str(keys_file))))


def test_inconsistent_config_is_rejected():
    with pytest.raises(ConfigError, match="api_keys"):
        TierResolver(Config(api_keys=[ApiKeyConfig(key="k", tenant="t", tier="gold")]))
    with pytest.raises(ConfigError, match="default_tier"):
        validate_admission_config(Config(default_tier="gold"))
    with pytest.raises(ConfigError, match="duplicate"):
        validate_admission_config(Config(tiers=[TierConfig(name="a"), TierConfig(name="a")], default_tier="a"))
    with pytest.raises(ConfigError, match="reserved_kv_fraction"):
        validate_admission_config(Config(tiers=[
            TierConfig(name="a", reserved_kv_fraction=0.6), TierConfig(name="b", reserved_kv_fraction=0.5),
        ], default_tier="a"))
    with pytest.raises(ConfigError, match="listed twice"):
        TierResolver(Config(api_keys=[KEYS[0], KEYS[0]]))


def test_unknown_config_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="reserved_share"):
        with_overrides(Config(), admission={"reserved_share": 0.1})
