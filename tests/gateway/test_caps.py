"""Output caps: effective max_tokens = min(request or tier default, tier max, server cap, pressure cap, context)."""

from __future__ import annotations

import pytest

from gateway.admission.caps import OutputCapper, effective_max_tokens
from gateway.admission.pressure import PressureMonitor
from shared.config import (
    AdmissionConfig,
    Config,
    GatewayConfig,
    ModelConfig,
    PressureConfig,
    PressureLevelConfig,
    TierConfig,
)
from shared.errors import ErrorCode, SluiceError

TIERS = [
    TierConfig(name="vip", priority=2, default_max_tokens=1024, max_tokens=3000),
    TierConfig(name="standard", priority=1, default_max_tokens=512, max_tokens=1024),
    TierConfig(name="free", priority=0, default_max_tokens=5000, max_tokens=256),
]
LEVEL = PressureLevelConfig(
    enter_queue_wait_s=2.0,
    leave_queue_wait_s=1.0,
    enter_kv_used_fraction=0.9,
    leave_kv_used_fraction=0.8,
    max_tokens_by_tier={"standard": 100},
)
PRESSURE = PressureConfig(
    elevated=LEVEL,
    critical=PressureLevelConfig(
        enter_queue_wait_s=8.0,
        leave_queue_wait_s=4.0,
        enter_kv_used_fraction=0.95,
        leave_kv_used_fraction=0.9,
        max_tokens_by_tier={"standard": 20},
    ),
)


def make_config(default_max_tokens: int = 2048, **admission: object) -> Config:
    return Config(
        model=ModelConfig(max_model_len_tokens=4096),
        gateway=GatewayConfig(max_tokens_cap=2048, default_max_tokens=default_max_tokens),
        tiers=TIERS,
        pressure=PRESSURE,
        admission=AdmissionConfig(**admission),  # type: ignore[arg-type]
    )


@pytest.fixture
def capper() -> OutputCapper:
    return OutputCapper(make_config())


def test_bc20_omitted_or_null_max_tokens_gets_the_tier_default(capper: OutputCapper):
    # The parser turns both an omitted and a null max_tokens into None.
    decision = capper.cap("standard", None, prompt_tokens=10)
    assert decision.max_tokens == 512 and decision.limited_by == "tier_default"


def test_bc20_tier_default_is_capped_too(capper: OutputCapper):
    # free's default (5000) is above its own max (256): the default never expands past the cap.
    decision = capper.cap("free", None, prompt_tokens=10)
    assert decision.max_tokens == 256 and decision.limited_by == "tier_max"


def test_bc20_server_wide_cap_holds_for_every_tier(capper: OutputCapper):
    assert capper.cap("vip", 10 * 2048, prompt_tokens=10).max_tokens == 2048
    assert capper.cap("vip", 10 * 2048, prompt_tokens=10).limited_by == "server_cap"
    for tier, tier_max in (("standard", 1024), ("free", 256)):
        assert capper.cap(tier, 10 * 2048, prompt_tokens=10).max_tokens == tier_max


@pytest.mark.parametrize("requested", [-1, 0])
def test_bc20_negative_or_zero_max_tokens_is_a_400_naming_the_field(capper: OutputCapper, requested: int):
    with pytest.raises(SluiceError) as info:
        capper.cap("standard", requested, prompt_tokens=10, param="max_completion_tokens")
    assert info.value.code is ErrorCode.INVALID_VALUE
    assert info.value.status == 400
    assert info.value.param == "max_completion_tokens"


def test_a_request_below_every_cap_is_kept(capper: OutputCapper):
    decision = capper.cap("standard", 40, prompt_tokens=10)
    assert decision.max_tokens == 40 and decision.limited_by == "request"


def test_context_room_caps_the_output(capper: OutputCapper):
    decision = capper.cap("vip", 2000, prompt_tokens=4000)
    assert decision.max_tokens == 96 and decision.limited_by == "context"


def test_a_prompt_that_fills_the_context_is_a_400(capper: OutputCapper):
    with pytest.raises(SluiceError) as info:
        capper.cap("vip", None, prompt_tokens=4096, prompt_param="prompt")
    assert info.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and info.value.param == "prompt"


def test_pressure_caps_tighten_with_the_level():
    clock_s = [0.0]
    config = make_config()
    monitor = PressureMonitor(config.pressure, clock=lambda: clock_s[0])
    capper = OutputCapper(config, monitor)
    assert capper.cap("standard", None, 10).max_tokens == 512
    monitor.observe(queue_wait_s=3.0, kv_used_fraction=0.0)
    assert capper.cap("standard", None, 10).max_tokens == 100
    assert capper.cap("standard", None, 10).limited_by == "pressure"
    assert capper.cap("vip", None, 10).max_tokens == 1024  # no pressure cap for vip at this level
    monitor.observe(queue_wait_s=9.0, kv_used_fraction=0.0)
    assert capper.cap("standard", 50, 10).max_tokens == 20


def test_admission_disabled_keeps_only_the_server_cap_and_context():
    capper = OutputCapper(make_config(default_max_tokens=300, enabled=False))
    assert capper.cap("free", None, 10).max_tokens == 300  # gateway.default_max_tokens, not the tier's
    assert capper.cap("free", 5000, 10).max_tokens == 2048


def test_server_default_bounds_the_tier_default():
    capper = OutputCapper(make_config(default_max_tokens=300))
    decision = capper.cap("vip", None, prompt_tokens=10)  # vip's own default is 1024
    assert decision.max_tokens == 300 and decision.limited_by == "server_default"
    assert capper.cap("vip", 1000, prompt_tokens=10).max_tokens == 1000  # an explicit request is not bounded by it


def test_context_length_from_the_workers_overrides_the_config(capper: OutputCapper):
    assert capper.cap("vip", 3000, prompt_tokens=10, max_model_len_tokens=1010).max_tokens == 1000
    with pytest.raises(SluiceError) as info:
        capper.cap("vip", None, prompt_tokens=1010, max_model_len_tokens=1010)
    assert info.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED


def test_plain_function_still_caps_a_missing_request():
    assert effective_max_tokens(None, 10, 4096, max_tokens_cap=100, default_max_tokens=512) == 100
