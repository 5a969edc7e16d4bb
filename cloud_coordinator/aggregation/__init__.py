"""Byzantine-robust aggregation core of the cloud coordinator (pure numpy).

Rules map stacked client updates (n, d) -- client weights minus the global
weights -- to one (d,) update and say who was left out and why. No I/O, no
clocks; randomness only through an injected ``np.random.Generator``.
"""
from __future__ import annotations

from ._errors import AggregationError
from ._parallel import workers
from ._result import AggregateResult
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
from .rules import (
    bulyan,
    centered_clipping,
    coordinate_median,
    geometric_median,
    krum,
    krum_scores,
    mean,
    multi_krum,
    trimmed_mean,
)

__all__ = [
    "AggregateResult", "AggregationError", "Aggregator", "DEFAULT_RULE", "Mixed",
    "PREAGGREGATORS", "RULES", "bucketing", "bulyan", "centered_clipping", "coordinate_median",
    "describe", "direct_sq_distances", "geometric_median", "get_rule", "krum", "krum_scores",
    "mean", "multi_krum", "nnm", "norm_clip", "pairwise_sq_distances", "quorum", "robust_default",
    "row_norms", "trimmed_mean", "workers",
]
