"""Errors of the aggregation core."""
from __future__ import annotations

from runtime.errors import FoglineError

__all__ = ["AggregationError"]


class AggregationError(FoglineError, ValueError):
    """Invalid arguments to an aggregation rule (shapes, f too large, non-finite rows)."""
