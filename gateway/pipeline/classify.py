"""Authenticate and classify: API key → tenant and tier (DESIGN.md, step 2).

- A key from ``[[api_keys]]`` in config.toml or from ``admission.keys_file`` maps to a tenant and a tier.
- A request without a key, or with a key that is not configured, gets ``default_tier`` as tenant ``anonymous``;
  with ``admission.require_api_key`` it gets 401 ``invalid_api_key`` instead.
- A client may lower its tier with the ``service_tier`` body field or the ``x-sluice-tier`` header (the lower of
  the two wins) but never raise it: asking for a higher tier keeps the key's own. OpenAI's own ``service_tier``
  values are understood: ``auto``/``default``/``priority``/``scale`` keep the tier, ``flex`` means the lowest tier.
  An unknown name is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.config import ApiKeyConfig, Config, TierConfig, effective_tiers, validate_admission_config
from shared.config_checks import index_api_keys, load_api_keys
from shared.errors import ErrorCode, SluiceError

ANONYMOUS_TENANT = "anonymous"
# OpenAI ``service_tier`` values that never change the tier (asking for more than one has is not an error).
_KEEP_TIER_VALUES = frozenset({"auto", "default", "priority", "scale"})
_LOWEST_TIER_VALUES = frozenset({"flex"})


@dataclass(frozen=True)
class Principal:
    """Who sent a request and how it is served.

    Attributes:
        tenant: the key's owner, or ``anonymous``.
        tier: the tier the request is served in (after any lowering).
        key_tier: the tier of the key itself (before lowering).
        rate_limit_key: identity for per-key rate limits (the API key, or ``anonymous``).
        rpm_limit: requests per minute allowed for this key; 0 = unlimited.
        tpm_limit: tokens per minute allowed for this key; 0 = unlimited.
    """

    tenant: str
    tier: TierConfig
    key_tier: TierConfig
    rate_limit_key: str
    rpm_limit: int
    tpm_limit: int


class TierResolver:
    """Map a request's API key and tier hints to a :class:`Principal`.

    Args:
        config: tiers, default tier, admission switches and ``api_keys``.
        api_keys: the keys to know; None = :func:`load_api_keys` (reads ``admission.keys_file``; call at start,
            off the event loop or before it runs).

    Raises:
        ConfigError: inconsistent tiers/keys (see :func:`shared.config.validate_admission_config` and
            :func:`shared.config_checks.index_api_keys`).
    """

    def __init__(self, config: Config, api_keys: list[ApiKeyConfig] | None = None) -> None:
        validate_admission_config(config)
        self._config = config
        self._tiers: dict[str, TierConfig] = {tier.name: tier for tier in effective_tiers(config)}
        self._lowest_tier = min(self._tiers.values(), key=lambda tier: tier.priority)
        self._keys = index_api_keys(config, load_api_keys(config) if api_keys is None else api_keys)
        self.tier_header = config.admission.tier_header

    def tier(self, name: str) -> TierConfig:
        """Return a tier by name.

        Raises:
            KeyError: no such tier.
        """
        return self._tiers[name]

    @property
    def tier_names(self) -> list[str]:
        """Return tier names, highest priority first."""
        return [tier.name for tier in sorted(self._tiers.values(), key=lambda tier: -tier.priority)]

    def resolve(
        self,
        authorization: str | None,
        header_tier: str | None = None,
        body_service_tier: str | None = None,
    ) -> Principal:
        """Authenticate a request and pick its tier.

        Args:
            authorization: the ``Authorization`` header value (``Bearer <key>``), or None.
            header_tier: the value of the ``x-sluice-tier`` header (``admission.tier_header``), or None.
            body_service_tier: the ``service_tier`` body field, or None.

        Returns:
            The principal with the tier to serve the request in.

        Raises:
            SluiceError: 401 ``invalid_api_key`` when a key is required and missing or unknown; 400
                ``invalid_value`` naming the field for an unknown tier name.
        """
        api_key = _bearer_token(authorization)
        entry = self._keys.get(api_key) if api_key else None
        if entry is None and self._config.admission.require_api_key:
            message = (
                "Incorrect API key provided." if api_key else "You didn't provide an API key. Send it as "
                "'Authorization: Bearer <key>'."
            )
            raise SluiceError(ErrorCode.INVALID_API_KEY, message)
        if entry is None:
            key_tier = self._tiers[self._config.default_tier]
            tenant, rate_limit_key = ANONYMOUS_TENANT, ANONYMOUS_TENANT
            rpm_limit, tpm_limit = key_tier.rpm_limit, key_tier.tpm_limit
        else:
            key_tier = self._tiers[entry.tier]
            tenant, rate_limit_key = entry.tenant, entry.key
            rpm_limit = key_tier.rpm_limit if entry.rpm_limit is None else entry.rpm_limit
            tpm_limit = key_tier.tpm_limit if entry.tpm_limit is None else entry.tpm_limit
        tier = key_tier
        for value, param in ((body_service_tier, "service_tier"), (header_tier, self.tier_header)):
            asked = self._asked_tier(value, param)
            if asked is not None and asked.priority < tier.priority:
                tier = asked
        return Principal(
            tenant=tenant,
            tier=tier,
            key_tier=key_tier,
            rate_limit_key=rate_limit_key,
            rpm_limit=rpm_limit,
            tpm_limit=tpm_limit,
        )

    def _asked_tier(self, value: str | None, param: str) -> TierConfig | None:
        if value is None:
            return None
        name = value.strip().lower()
        if name in self._tiers:
            return self._tiers[name]
        if name in _LOWEST_TIER_VALUES:
            return self._lowest_tier
        check_tier_hint(value, param, self._tiers)
        return None


def check_tier_hint(value: str | None, param: str, tier_names: Iterable[str]) -> None:
    """Check a tier hint (the ``service_tier`` body field, the tier header): one of ``tier_names`` or of OpenAI's
    ``service_tier`` values, in any case, or empty (the job endpoints check a job's so, as a request's is checked,
    though a job runs in the lowest tier whatever it asks).

    Raises:
        SluiceError: 400 ``invalid_value`` naming ``param`` and the valid values.
    """
    if value is None:
        return
    name = value.strip().lower()
    names = set(tier_names)
    if name in names or name in _KEEP_TIER_VALUES or name in _LOWEST_TIER_VALUES or name == "":
        return
    valid = sorted(names) + sorted(_KEEP_TIER_VALUES | _LOWEST_TIER_VALUES)
    raise SluiceError(
        ErrorCode.INVALID_VALUE,
        f"Invalid '{param}': {value!r} is not a tier. Valid values: {', '.join(valid)}.",
        param=param,
    )


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
