"""The order both checkpoint readers hand weights over in: one decoder layer at a time."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def in_layer_order(items: Iterable[T], layer_match: Callable[[T], re.Match | None]) -> list[list[T]]:
    """`items` grouped by decoder layer, in layer order, then those of no layer (the embedding,
    the final norm, the output layer). `layer_match` finds an item's layer index, as the
    first group of a regular-expression match, or None."""
    groups: dict[int | None, list[T]] = {}
    for item in items:
        match = layer_match(item)
        groups.setdefault(int(match.group(1)) if match else None, []).append(item)
    return [groups[key] for key in sorted(groups, key=lambda layer: (layer is None, layer or 0))]
