"""Pressure levels: normal / elevated / critical from the predicted queue wait and KV usage (DESIGN.md).

Each level above normal has its own policy in ``config.toml`` (``[pressure.elevated]``, ``[pressure.critical]``):
output-token caps per tier, queue-wait deadlines per tier, and tiers shed outright at arrival. Normal uses the
tiers' own settings.

Transitions use hysteresis so the level does not flap at a threshold:

```
 signal ▲           enter critical ─────────────────────────────────
        │         leave critical ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─
        │        enter elevated ──────────────────────────────────
        │      leave elevated ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─
        └──────────────────────────────────────────────────────▶ time
```

- Going up is immediate and may skip a level: a level is entered as soon as the queue wait **or** the KV usage
  reaches its ``enter_*`` threshold.
- Going down is one level at a time: the current level is left only when the queue wait **and** the KV usage are
  both below its ``leave_*`` thresholds **and** it has lasted at least ``min_dwell_s``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from shared.config import PressureConfig, PressureLevelConfig, TierConfig


class PressureStats(msgspec.Struct):
    """The pressure level and the signals it was last computed from.

    Attributes:
        level: ``normal``, ``elevated`` or ``critical``.
        in_level_s: seconds since the level was entered.
        queue_wait_s: the last queue-wait signal, seconds.
        kv_used_fraction: the last KV signal, 0–1.
        num_transitions: level changes so far.
    """

    level: str
    in_level_s: float
    queue_wait_s: float
    kv_used_fraction: float
    num_transitions: int


class PressureLevel(enum.IntEnum):
    """Ordered pressure levels; a larger value is more pressure."""

    NORMAL = 0
    ELEVATED = 1
    CRITICAL = 2

    @property
    def label(self) -> str:
        """Return the lower-case name used in ``/status``, metrics and logs."""
        return self.name.lower()


class PressureMonitor:
    """Track the pressure level from observations and answer the current level's policy.

    Args:
        config: thresholds, dwell time and per-level policies.
        clock: monotonic time in seconds (injectable for tests).
    """

    def __init__(self, config: PressureConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._levels: dict[PressureLevel, PressureLevelConfig] = {
            PressureLevel.ELEVATED: config.elevated,
            PressureLevel.CRITICAL: config.critical,
        }
        self._level = PressureLevel.NORMAL
        self._entered_at_s = clock()
        self._last_queue_wait_s = 0.0
        self._last_kv_used_fraction = 0.0
        self.num_transitions = 0

    @property
    def level(self) -> PressureLevel:
        """Return the current level."""
        return self._level

    def observe(self, queue_wait_s: float, kv_used_fraction: float) -> PressureLevel:
        """Feed the latest signals and return the (possibly new) level.

        Args:
            queue_wait_s: predicted queue wait in seconds (the admission controller's estimate).
            kv_used_fraction: used KV blocks ÷ total KV blocks over the workers, 0–1.
        """
        self._last_queue_wait_s = queue_wait_s
        self._last_kv_used_fraction = kv_used_fraction
        now_s = self._clock()
        target = PressureLevel.NORMAL
        for level in (PressureLevel.CRITICAL, PressureLevel.ELEVATED):
            cfg = self._levels[level]
            if queue_wait_s >= cfg.enter_queue_wait_s or kv_used_fraction >= cfg.enter_kv_used_fraction:
                target = level
                break
        if target > self._level:
            self._move_to(target, now_s)
        elif self._level > PressureLevel.NORMAL and now_s - self._entered_at_s >= self._config.min_dwell_s:
            cfg = self._levels[self._level]
            if queue_wait_s < cfg.leave_queue_wait_s and kv_used_fraction < cfg.leave_kv_used_fraction:
                self._move_to(PressureLevel(self._level - 1), now_s)
        return self._level

    def _move_to(self, level: PressureLevel, now_s: float) -> None:
        self._level = level
        self._entered_at_s = now_s
        self.num_transitions += 1

    def _policy(self) -> PressureLevelConfig | None:
        return self._levels.get(self._level)

    def max_tokens_cap(self, tier: str) -> int | None:
        """Return the current level's output-token cap for a tier, or None when the level sets none."""
        policy = self._policy()
        return None if policy is None else policy.max_tokens_by_tier.get(tier)

    def queue_timeout_s(self, tier: str, default_s: float) -> float:
        """Return the current level's queue-wait deadline for a tier in seconds, else ``default_s``; a level only
        tightens a deadline (never above ``default_s``, the tier's own)."""
        policy = self._policy()
        return default_s if policy is None else min(default_s, policy.queue_timeout_s_by_tier.get(tier, default_s))

    def sheds(self, tier: str) -> bool:
        """Return whether the current level rejects this tier at arrival."""
        policy = self._policy()
        return policy is not None and tier in policy.shed_tiers

    def sheds_at_some_level(self, tier: str) -> bool:
        """Return whether some level above normal rejects this tier (its ``shed_tiers``)."""
        return any(tier in policy.shed_tiers for policy in self._levels.values())

    def seconds_until_may_step_down(self) -> float:
        """Return the seconds left of the minimum dwell in the current level (0 at normal or when passed)."""
        if self._level is PressureLevel.NORMAL:
            return 0.0
        return max(0.0, self._config.min_dwell_s - (self._clock() - self._entered_at_s))

    def stats(self) -> PressureStats:
        """Return the level, the time in it and the last signals, for ``/status``."""
        return PressureStats(
            level=self._level.label,
            in_level_s=round(self._clock() - self._entered_at_s, 3),
            queue_wait_s=round(self._last_queue_wait_s, 3),
            kv_used_fraction=round(self._last_kv_used_fraction, 4),
            num_transitions=self.num_transitions,
        )

    def snapshot(self) -> dict[str, Any]:
        """Return :meth:`stats` as JSON-ready builtins."""
        return msgspec.to_builtins(self.stats())


def pressure_signal_tier(tiers: Sequence[TierConfig], pressure: PressureMonitor) -> TierConfig:
    """Return the tier whose queue wait is the pressure level's signal: the lowest-priority tier that no pressure
    level sheds (:meth:`PressureMonitor.sheds_at_some_level`), else the lowest tier.

    The work of a tier that pressure may shed yields to every other tier (jobs run in the lowest tier and fill
    valleys), so its own backlog says nothing of the service the others get; counting it would let a backlog of
    sheddable work raise the level that sheds it and tighten every tier's caps and deadlines.

    Args:
        tiers: the effective tiers, highest priority first.
    """
    kept = [tier for tier in tiers if not pressure.sheds_at_some_level(tier.name)]
    return (kept or list(tiers))[-1]
