"""The value every aggregation rule returns, and the spec every rule declares (``RuleSpec``)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["AggregateResult", "RuleSpec", "positive", "count"]


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


def positive(v: object) -> bool:
    """An option check: a finite number above zero."""
    return isinstance(v, (int, float, np.integer, np.floating)) and bool(np.isfinite(v)) and bool(v > 0)


def count(v: object) -> bool:
    """An option check: an integer >= 1."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and bool(v >= 1)


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """Everything the registry and the package know of one aggregation rule, kept next to its core.

    ``core(x, w, *, f, **options)`` runs on finite rows and raises ``NonFinite`` when it meets NaN/Inf;
    ``nonfinite`` says what the registry does then: ``"reject"`` drops those clients (reason "non-finite
    values") and reruns the core on the rest. ``options`` maps each option the rule takes to its
    check (construction fails on a bad value, not round 37); ``min_clients(f)`` is the fewest rows
    the rule accepts for ``f``; a ``stateful`` core takes and returns ``state`` across rounds.
    ``function`` is the public, guarded rule the package exports.
    """

    name: str
    core: Callable[..., AggregateResult]
    function: Callable[..., AggregateResult]
    min_clients: Callable[[int], int]
    options: Mapping[str, Callable[[object], bool]] = field(default_factory=dict)
    nonfinite: str = "reject"
    stateful: bool = False
