"""Per-worker circuit breakers (DESIGN.md, step 6).

The pattern is Michael Nygard's circuit breaker ("Release It!", 2007): a breaker is **closed** while calls
succeed; after ``failure_threshold`` consecutive failures or timeouts it **opens** and the router sends the worker
nothing; after ``cooldown_s`` it goes **half-open** and lets exactly one probe request through; the probe's success
closes it, its failure opens it again for another cooldown.

```
            failure_threshold consecutive failures
  CLOSED ─────────────────────────────────────────▶ OPEN
    ▲                                                │ cooldown_s elapsed
    │ probe succeeds                                 ▼
    └──────────────────────────────────────────── HALF_OPEN ── probe fails ──▶ OPEN
```

Usage by the worker pool (one breaker per worker)::

    if breaker.available():          # peek, no side effect: may this worker be picked?
        ...pick the worker...
        breaker.allow_request()      # take the slot (in half-open: the one probe)
        ...send...
        breaker.on_success() | breaker.on_failure() | breaker.on_abandoned()
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any


class BreakerState(str, enum.Enum):
    """The three states of a circuit breaker."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Closed → open after N consecutive failures → half-open after a cooldown with one probe → closed or open.

    Args:
        failure_threshold: consecutive failures or timeouts that open a closed breaker (≥ 1).
        cooldown_s: seconds an open breaker waits before letting one probe through.
        clock: monotonic time in seconds (injectable for tests).

    Raises:
        ValueError: ``failure_threshold`` < 1 or ``cooldown_s`` < 0.
    """

    def __init__(
        self, failure_threshold: int = 5, cooldown_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be ≥ 1, got {failure_threshold}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be ≥ 0, got {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._num_consecutive_failures = 0
        self._opened_at_s = 0.0
        self._probe_in_flight = False
        self.num_opens = 0

    @property
    def state(self) -> BreakerState:
        """Return the state; an open breaker whose cooldown has passed reads as half-open."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at_s >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._probe_in_flight = False
        return self._state

    def available(self) -> bool:
        """Return whether a request may be sent now, without taking the slot (no side effect on the probe)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._probe_in_flight)

    def allow_request(self) -> bool:
        """Take the right to send one request: always when closed, the single probe when half-open.

        Returns:
            True when the request may go; the caller must then report ``on_success``, ``on_failure`` or
            ``on_abandoned`` for it.
        """
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return True
        return False

    def on_success(self) -> None:
        """Record a successful request: reset the failure count; a successful probe closes the breaker."""
        self._num_consecutive_failures = 0
        if self._state is BreakerState.HALF_OPEN:
            self._state = BreakerState.CLOSED
            self._probe_in_flight = False

    def on_failure(self) -> None:
        """Record a failure or timeout: the N-th in a row opens a closed breaker; a failed probe reopens it."""
        self._num_consecutive_failures += 1
        if self._state is BreakerState.HALF_OPEN or (
            self._state is BreakerState.CLOSED and self._num_consecutive_failures >= self.failure_threshold
        ):
            self._open()

    def on_abandoned(self) -> None:
        """Record a request that ended without a verdict (client cancelled it): a probe slot is freed."""
        if self._state is BreakerState.HALF_OPEN:
            self._probe_in_flight = False

    def seconds_until_probe(self) -> float:
        """Return the seconds until an open breaker lets its probe through (0.0 when it is not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self.cooldown_s - (self._clock() - self._opened_at_s))

    def probe_now(self) -> None:
        """Let an open breaker's probe through now instead of after its cooldown: the target answered a health
        check (an upstream engine reachable again), so the next request tests it at once."""
        if self._state is BreakerState.OPEN:
            self._state = BreakerState.HALF_OPEN
            self._probe_in_flight = False

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at_s = self._clock()
        self._probe_in_flight = False
        self.num_opens += 1

    def snapshot(self) -> dict[str, Any]:
        """Return state, consecutive failures and times opened, for ``/status``."""
        return {
            "state": self.state.value,
            "consecutive_failures": self._num_consecutive_failures,
            "num_opens": self.num_opens,
        }
