"""An upstream's work rates from its token counters, as the ``Capacity`` fields admission reads.

Admission predicts waits from how fast the pool drains prompt + output tokens per busy second
(``Capacity.busy_tokens_per_s``) and how fast one running sequence decodes. A worker of ours measures them per
engine step; an upstream gives cumulative counters (or none: then the gateway counts the tokens it streamed itself).

Engines count at different moments: vLLM and SGLang add tokens every step, llama.cpp adds a request's prompt
tokens when its prompt is done and its output tokens only when the request ends (``llamacpp:tokens_predicted_total``
stands still through a whole answer, then jumps). So a reading while the engine is busy but its counters have not
moved is no sample of zero: the span goes on until they move, and the tokens they gained are spread over all of it.
The rates are the tokens of the spans that ended in the last :data:`RATE_WINDOW_S` seconds ÷ those spans' seconds (a
ratio of sums: staggered ends of long answers average out, where a mean of per-span ratios would swing with each
jump); idle time is in no span and leaves the rates as they were (a rate is what the engine does when it works).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0  # seconds of busy spans the rates average over (a few request ends on a slow CPU engine)


@dataclass
class UpstreamRates:
    """Prompt and output tokens/s of one upstream while busy.

    Attributes:
        prefill_tokens_per_s: prompt tokens per busy second (0.0 until measured).
        decode_tokens_per_s: output tokens per busy second, summed over running requests (0.0 until measured).
    """

    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    _last_at_s: float | None = None
    _last_prompt_total: float = 0.0
    _last_generation_total: float = 0.0
    _spans: deque[tuple[float, float, float, float]] = field(default_factory=deque)  # end, seconds, prompt, output

    def observe(self, now_s: float, prompt_total: float, generation_total: float, busy: bool) -> None:
        """Take one reading of the cumulative counters (tokens since start) at monotonic time ``now_s``.

        Args:
            busy: the engine ran requests during the interval since the last reading.
        """
        last_at_s = self._last_at_s
        d_prompt = prompt_total - self._last_prompt_total
        d_generation = generation_total - self._last_generation_total
        restarted = last_at_s is None or now_s <= last_at_s or d_prompt < 0 or d_generation < 0
        moved = d_prompt > 0 or d_generation > 0
        if busy and not moved and not restarted:
            return  # busy, nothing counted yet: the span goes on
        self._last_at_s, self._last_prompt_total, self._last_generation_total = now_s, prompt_total, generation_total
        if restarted or not moved:
            return  # the first reading, the engine restarted (counters went back), or idle: a new span starts
        spans = self._spans
        spans.append((now_s, now_s - last_at_s, d_prompt, d_generation))
        _drop_before_window(spans, now_s)
        seconds = sum(span[1] for span in spans)
        self.prefill_tokens_per_s = sum(span[2] for span in spans) / seconds
        self.decode_tokens_per_s = sum(span[3] for span in spans) / seconds

    @property
    def busy_tokens_per_s(self) -> float:
        """Prompt + output tokens per busy second."""
        return self.prefill_tokens_per_s + self.decode_tokens_per_s


@dataclass
class StreamDecodeRate:
    """The decode speed one running request gets, from the streams the gateway itself reads: each ended stream's
    tokens after its first ÷ the seconds from its first token to its last, as a ratio of sums over the streams that
    ended in the last :data:`RATE_WINDOW_S` seconds. It is what a slot's remaining time depends on (the engine's
    mix of prefills and decodes included), measured without the engine's counters: llama.cpp's count a request's
    output only when it ends, and an aborted (preempted) request's perhaps never.

    Attributes:
        tokens_per_s: output tokens per second of one stream, 0.0 until a stream of two tokens or more has ended.
    """

    tokens_per_s: float = 0.0
    _streams: deque[tuple[float, float, float]] = field(default_factory=deque)  # end, tokens after first, seconds

    def observe(self, now_s: float, num_tokens: int, first_token_s: float, last_token_s: float) -> None:
        """Record one ended stream of ``num_tokens`` tokens whose first and last came at ``first_token_s`` and
        ``last_token_s`` (monotonic seconds, like ``now_s``); streams of fewer than two tokens say nothing."""
        seconds = last_token_s - first_token_s
        if num_tokens < 2 or seconds <= 0:
            return
        streams = self._streams
        streams.append((now_s, num_tokens - 1, seconds))
        _drop_before_window(streams, now_s)
        self.tokens_per_s = sum(s[1] for s in streams) / sum(s[2] for s in streams)


def _drop_before_window(entries: deque[tuple[float, ...]], now_s: float) -> None:
    """Drop the entries (each led by its end time, seconds) that ended more than :data:`RATE_WINDOW_S` before
    ``now_s``; the newest always stays, so a rate measured once lasts through idle time."""
    while len(entries) > 1 and entries[0][0] < now_s - RATE_WINDOW_S:
        entries.popleft()
