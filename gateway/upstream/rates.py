"""An upstream's work rates from its token counters, as the ``Capacity`` fields admission reads.

Admission predicts waits from how fast the pool drains prompt + output tokens per busy second
(``Capacity.busy_tokens_per_s``) and how fast one running sequence decodes. A worker of ours measures them per
engine step; an upstream gives cumulative counters (or none: then the gateway counts the tokens it streamed itself).
Between two polls while the engine was busy, the counter increase ÷ elapsed seconds is one sample; samples are
smoothed exponentially with time constant :data:`RATE_TIME_CONSTANT_S`, and idle intervals leave the rates as they
were (a rate is what the engine does when it works).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RATE_TIME_CONSTANT_S = 2.0


@dataclass
class UpstreamRates:
    """Smoothed prompt and output tokens/s of one upstream while busy.

    Attributes:
        prefill_tokens_per_s: prompt tokens per busy second (0.0 until measured).
        decode_tokens_per_s: output tokens per busy second, summed over running requests (0.0 until measured).
    """

    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    _last_at_s: float | None = None
    _last_prompt_total: float = 0.0
    _last_generation_total: float = 0.0

    def observe(self, now_s: float, prompt_total: float, generation_total: float, busy: bool) -> None:
        """Take one reading of the cumulative counters (tokens since start) at monotonic time ``now_s``.

        Args:
            busy: the engine ran requests during the interval since the last reading.
        """
        last_at_s = self._last_at_s
        d_prompt = prompt_total - self._last_prompt_total
        d_generation = generation_total - self._last_generation_total
        self._last_at_s, self._last_prompt_total, self._last_generation_total = now_s, prompt_total, generation_total
        if last_at_s is None or now_s <= last_at_s or d_prompt < 0 or d_generation < 0:
            return  # the first reading, or the engine restarted (counters went back)
        if not busy and d_prompt == 0 and d_generation == 0:
            return
        dt_s = now_s - last_at_s
        weight = 1.0 - math.exp(-dt_s / RATE_TIME_CONSTANT_S)
        if self.decode_tokens_per_s == 0.0 and self.prefill_tokens_per_s == 0.0:
            weight = 1.0
        self.prefill_tokens_per_s += weight * (d_prompt / dt_s - self.prefill_tokens_per_s)
        self.decode_tokens_per_s += weight * (d_generation / dt_s - self.decode_tokens_per_s)

    @property
    def busy_tokens_per_s(self) -> float:
        """Prompt + output tokens per busy second."""
        return self.prefill_tokens_per_s + self.decode_tokens_per_s
