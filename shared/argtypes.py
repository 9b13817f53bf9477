"""``argparse`` types for the command-line tools (``sluice plan``, ``sluice cachesim``): a bad value is a usage
error (exit code 2) that names the option and the allowed range, never a traceback."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type[int] | type[float], rule: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """Return an argparse type: a finite ``kind`` for which ``ok`` holds; errors quote ``rule`` (e.g. "> 0")."""

    def parse(text: str) -> float:
        noun = "an integer" if kind is int else "a number"
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} {rule}, got {text!r}") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"must be {noun} {rule}, got {text}")
        return value

    return parse


POSITIVE_FLOAT = number(float, "> 0", lambda v: v > 0)
NON_NEGATIVE_FLOAT = number(float, "≥ 0", lambda v: v >= 0)
NON_NEGATIVE_INT = number(int, "≥ 0", lambda v: v >= 0)
POSITIVE_INT = number(int, "≥ 1", lambda v: v >= 1)
