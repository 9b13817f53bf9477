"""The engine's measured speeds: tokens per busy second of its steps, per phase, over a window of busy time.

A step prefills prompt chunks and decodes running sequences together (chunked prefill), so a step's time counts
for each phase it did: a mixed step is a step "spent prefilling" and a step "spent decoding". Idle time between
steps counts for neither, and the window is busy seconds, not wall seconds, so an idle worker keeps reporting the
speeds it last measured instead of rates diluted by idleness.

::

    step:         [ P=512 ]  [ P=200 D=8 ]  [ D=8 ]  [ D=8 ]      idle       [ D=8 ]
    prefill s:    t0         t1                                              -
    decode s:     -          t1             t2       t3                     t4
    prefill_tokens_per_s  = 712 / (t0 + t1)         how fast prompts go while being prefilled
    decode_tokens_per_s   = 32 / (t1 + t2 + t3 + t4)  output tokens per second of decoding (mean batch / TPOT)
    sequence_decode_tokens_per_s = 4 / (t1 + ... + t4) = 1 / TPOT: the tokens/s one running sequence gets
    busy_tokens_per_s     = 744 / (t0 + ... + t4)   all work per busy second (what a backlog drains at)

The phase rates are not additive: with mixed steps each phase counts the shared time, so the work a worker drains
per busy second is ``busy_tokens_per_s``, not their sum.
"""

from __future__ import annotations

import collections

WINDOW_BUSY_S = 5.0  # each rate covers at least the last this-many busy seconds of its phase (or all it saw)


class BusyRate:
    """Tokens per busy second over the most recent samples that cover :data:`WINDOW_BUSY_S` busy seconds.

    The newest sample always counts, so a single step longer than the window still gives its own rate.
    """

    def __init__(self, window_busy_s: float = WINDOW_BUSY_S) -> None:
        self._window_busy_s = window_busy_s
        self._samples: collections.deque[tuple[int, float]] = collections.deque()  # (tokens, busy_s)
        self._tokens = 0
        self._busy_s = 0.0

    def add(self, num_tokens: int, busy_s: float) -> None:
        """Count ``num_tokens`` done in ``busy_s`` seconds of engine time (a step, or a step's share)."""
        self._samples.append((num_tokens, busy_s))
        self._tokens += num_tokens
        self._busy_s += busy_s
        while len(self._samples) > 1 and self._busy_s - self._samples[0][1] >= self._window_busy_s:
            old_tokens, old_busy_s = self._samples.popleft()
            self._tokens -= old_tokens
            self._busy_s -= old_busy_s

    def tokens_per_s(self) -> float:
        """Return tokens per busy second over the window, 0.0 before any sample."""
        return self._tokens / self._busy_s if self._busy_s > 0 else 0.0


class StepRates:
    """The four speeds a worker reports in ``Capacity``, fed one step at a time (see the module docstring)."""

    def __init__(self, window_busy_s: float = WINDOW_BUSY_S) -> None:
        self._prefill = BusyRate(window_busy_s)  # prompt tokens per second of steps that prefill
        self._decode = BusyRate(window_busy_s)  # decode tokens per second of steps that decode
        self._decode_steps = BusyRate(window_busy_s)  # decode steps per second of steps that decode: 1 / TPOT
        self._busy = BusyRate(window_busy_s)  # all tokens per second of all steps

    def observe(self, num_prefill_tokens: int, num_decode_tokens: int, step_s: float) -> None:
        """Count one step that computed ``num_prefill_tokens`` prompt tokens and decoded ``num_decode_tokens``
        sequences (one token each) in ``step_s`` seconds of engine time."""
        if num_prefill_tokens + num_decode_tokens <= 0:
            return
        self._busy.add(num_prefill_tokens + num_decode_tokens, step_s)
        if num_prefill_tokens:
            self._prefill.add(num_prefill_tokens, step_s)
        if num_decode_tokens:
            self._decode.add(num_decode_tokens, step_s)
            self._decode_steps.add(1, step_s)

    def prefill_tokens_per_s(self) -> float:
        """Return prompt tokens per second of the steps that prefill (0.0 before any)."""
        return self._prefill.tokens_per_s()

    def decode_tokens_per_s(self) -> float:
        """Return decode tokens per second of the steps that decode, summed over the batch (0.0 before any)."""
        return self._decode.tokens_per_s()

    def sequence_decode_tokens_per_s(self) -> float:
        """Return decode steps per second of the steps that decode: 1 / TPOT, the tokens/s one running sequence
        gets whatever the batch (0.0 before any)."""
        return self._decode_steps.tokens_per_s()

    def busy_tokens_per_s(self) -> float:
        """Return prompt + decode tokens per second of all steps: the work drained per busy second (0.0 before
        any)."""
        return self._busy.tokens_per_s()
