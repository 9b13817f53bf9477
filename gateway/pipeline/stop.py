"""Stop strings: held back until they can no longer match, never leaked, across token boundaries.

Invariant: the text not yet released (``held``) is the longest suffix of the generated text that is a proper prefix
of some stop string. A stop string that completes later must start inside ``held``, so searching ``held + new`` finds
every match. The match that *ends* first wins (ties: the one that starts first), which makes the result independent
of how the text was cut into pieces. Everything before it is released; the match and everything after it are dropped
(OpenAI and vLLM exclude the stop string from the output).
"""

from __future__ import annotations


class StopStringMatcher:
    """Filter one generation's text through its stop strings.

    Args:
        stop_strings: non-empty strings; an empty list makes this a pass-through.
    """

    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add new generated text; return the text that is now safe to release.

        After a match (``self.matched`` set) the text before the stop string is returned and every later call
        returns "".
        """
        if self.matched is not None:
            return ""
        if not self.stop_strings:
            return text
        buffer = self._held + text
        best: tuple[int, int] | None = None  # (end, start) of the match that completes first
        for stop in self.stop_strings:
            index = buffer.find(stop)
            if index != -1 and (best is None or (index + len(stop), index) < best):
                best, self.matched = (index + len(stop), index), stop
        if best is not None:
            self._held = ""
            return buffer[:best[1]]
        hold_chars = self._longest_partial_match(buffer)
        self._held = buffer[len(buffer) - hold_chars:] if hold_chars else ""
        return buffer[:len(buffer) - hold_chars]

    @property
    def held(self) -> str:
        """The text pushed and not released yet (a suffix that may still start a stop string)."""
        return self._held

    def flush(self) -> str:
        """Release what is held back when the generation ends without a match."""
        if self.matched is not None:
            return ""
        held, self._held = self._held, ""
        return held

    def _longest_partial_match(self, buffer: str) -> int:
        """Return the length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
