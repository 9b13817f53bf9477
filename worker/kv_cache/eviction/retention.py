"""Retention under pressure: TTL scaling, retained and cached tiers per pressure level (DESIGN.md, KV cache)."""

from __future__ import annotations

from shared.config import RetentionConfig, RetentionSettings


PRESSURE_LEVELS = ("normal", "elevated", "critical")


def retention_for_pressure(level: str, config: RetentionConfig = RetentionConfig()) -> RetentionSettings:
    """Return the retention settings to apply at pressure ``level``.

    Raises:
        ValueError: unknown level; the message lists the valid ones.
    """
    if level not in PRESSURE_LEVELS:
        raise ValueError(f"unknown pressure level {level!r}; valid: {', '.join(PRESSURE_LEVELS)}")
    return getattr(config, level)


def block_expiry_s(settings: RetentionSettings, tier_priority: int, retention_s: float, now_s: float) -> float:
    """Return the ``BlockMeta.expires_at_s`` of a block released at ``now_s`` under ``settings``.

    Args:
        settings: the current level's settings (:func:`retention_for_pressure`).
        tier_priority: priority of the tier of the request releasing the block.
        retention_s: the request's retention wish in seconds, already bounded by its tier (``inf`` = none).
        now_s: release time on the policy clock, seconds.
    """
    if tier_priority < settings.min_retained_tier_priority:
        return now_s
    scaled_s = retention_s * settings.ttl_scale if settings.ttl_scale > 0 else 0.0  # inf × 0 would be nan
    return now_s + min(scaled_s, settings.max_ttl_s)


def caches_new_request(settings: RetentionSettings, tier_priority: int) -> bool:
    """Whether a request of a tier with ``tier_priority`` admitted now may put its blocks in the prefix cache."""
    return tier_priority >= settings.min_cached_tier_priority
