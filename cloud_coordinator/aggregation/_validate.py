"""Argument checks shared by every rule; non-finite rows are found lazily.

Scanning 200 MB for NaN costs as much as a Krum, so rules detect non-finite input
inside the passes they make anyway (``NonFinite``) and only then locate the rows.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

import numpy as np

from ._errors import AggregationError
from ._result import AggregateResult
from ._rows import RowStack

__all__ = [
    "NonFinite", "as_updates", "as_weights", "check_f", "nonfinite_rows", "guarded",
    "raise_nonfinite",
]

REASON_NONFINITE = "non-finite values"


class NonFinite(Exception):
    """Internal signal: a pass met NaN or Inf; the guard finds the rows."""


def as_updates(updates: object) -> np.ndarray:
    """Return a 2-D floating (n, d) view of the stacked client updates (no copy if possible).

    A ``RowStack`` (rows read from the clients' buffers) is returned as it is: the
    kernels index it like an array, chunk by chunk.
    """
    if isinstance(updates, RowStack):
        return updates  # type: ignore[return-value]
    x = np.asarray(updates)
    if x.ndim != 2:
        raise AggregationError(f"updates must be a 2-D array (n, d), got shape {x.shape}")
    n, d = x.shape
    if n < 1 or d < 1:
        raise AggregationError(f"updates must have at least one row and column, got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        if not (np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
            raise AggregationError(f"updates must be numeric, got dtype {x.dtype}")
        x = x.astype(np.float64)
    if x.dtype.itemsize < 4:
        x = x.astype(np.float32)
    return x


def as_weights(weights: object | None, n: int) -> np.ndarray:
    """Return normalised float64 weights (n,), uniform when None."""
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise AggregationError(f"weights must have shape ({n},), got {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise AggregationError("weights must be finite and non-negative")
    total = float(w.sum())
    if total <= 0.0:
        raise AggregationError("weights must not all be zero")
    return w / total


def check_f(rule: str, n: int, f: int, need: int) -> None:
    """Raise unless f is a non-negative int and n >= need (the rule's bound)."""
    if isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 0:
        raise AggregationError(f"{rule}: f must be a non-negative integer, got {f!r}")
    if n < need:
        raise AggregationError(f"{rule}: needs n >= {need} updates for f={f}, got n={n}")


def nonfinite_rows(x: np.ndarray) -> list[int]:
    """Indices of rows holding NaN or Inf (row by row, bounded memory)."""
    return [i for i in range(x.shape[0]) if not np.isfinite(x[i]).all()]


def raise_nonfinite(x: np.ndarray) -> NoReturn:
    """Turn the internal NonFinite signal into a clear AggregationError naming the rows."""
    bad = nonfinite_rows(x)
    if not bad:
        raise AggregationError("result overflowed float64 (updates too large)")
    raise AggregationError(f"non-finite values (NaN/Inf) in update rows {bad}")


Core = Callable[[np.ndarray, np.ndarray | None], AggregateResult]


def guarded(core: Core, x: np.ndarray, weights: object | None, reject: bool) -> AggregateResult:
    """Run ``core``; on non-finite input raise, or drop those rows and rerun (``reject``)."""
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    if w is not None and w.shape != (x.shape[0],):
        raise AggregationError(f"weights must have shape ({x.shape[0]},), got {w.shape}")
    try:
        return core(x, w)
    except NonFinite:
        bad = nonfinite_rows(x)
    if not bad:
        raise AggregationError("aggregate overflowed float64 (updates too large)")
    if not reject:
        raise AggregationError(f"non-finite values (NaN/Inf) in update rows {bad}")
    keep = np.setdiff1d(np.arange(x.shape[0]), bad)
    if keep.size == 0:
        raise AggregationError("every update holds non-finite values")
    res = core(x[keep], None if w is None else w[keep])
    rejected = {int(keep[i]): r for i, r in res.rejected.items()}
    rejected.update(dict.fromkeys(bad, REASON_NONFINITE))
    return replace(
        res,
        selected=tuple(int(keep[i]) for i in res.selected),
        rejected=dict(sorted(rejected.items())),
    )
