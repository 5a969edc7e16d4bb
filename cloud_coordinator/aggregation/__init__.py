"""Byzantine-robust aggregation core of the cloud coordinator (pure numpy).

Rules map stacked client updates (n, d) -- client weights minus the global
weights -- to one (d,) update and say who was left out and why. No I/O, no
clocks; randomness only through an injected ``np.random.Generator``.
"""
from __future__ import annotations

from . import rules as _rules
from ._errors import AggregationError
from ._parallel import workers
from ._result import AggregateResult, RuleSpec
from .clipping import norm_clip, row_norms
from .distances import direct_sq_distances, pairwise_sq_distances
from .preagg import Mixed, bucketing, nnm
from .registry import (
    DEFAULT_RULE,
    PREAGGREGATORS,
    RULES,
    Aggregator,
    describe,
    get_rule,
    quorum,
    robust_default,
)
from .rules import *  # noqa: F403 - every rule's guarded function (rules.__all__, beside each rule's spec)

__all__ = [
    "AggregateResult", "AggregationError", "Aggregator", "DEFAULT_RULE", "Mixed", "PREAGGREGATORS", "RULES",
    "RuleSpec", "bucketing", "describe", "direct_sq_distances", "get_rule", "nnm", "norm_clip",
    "pairwise_sq_distances", "quorum", "robust_default", "row_norms", "workers",
]
__all__ += _rules.__all__
