"""The value every aggregation rule returns."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["AggregateResult"]


@dataclass(frozen=True, slots=True, eq=False)
class AggregateResult:
    """One aggregated update plus who counted, who was rejected and why.

    ``update`` is float64 (d,). ``selected`` lists the client rows that entered the
    output; ``rejected`` maps client row -> fixed reason phrase (no numbers, so
    reasons can be counted); ``state`` carries what a stateful rule needs next round.
    """

    update: np.ndarray
    selected: tuple[int, ...]
    rejected: Mapping[int, str] = field(default_factory=dict)
    state: Mapping[str, Any] | None = None
