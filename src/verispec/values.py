"""Checks of values a user hands over, where Python's own types let too much through:
True and False are ints, and NaN and infinity are floats."""

from __future__ import annotations

import math


def is_whole(value: object, low: float = -math.inf, high: float = math.inf) -> bool:
    """An int, not True or False, in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: object, low: float = -math.inf, high: float = math.inf) -> bool:
    """A finite int or float, not True or False, in [low, high]."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)
