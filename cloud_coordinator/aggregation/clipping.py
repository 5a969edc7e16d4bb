"""Per-client norm clipping: bounds any single client's pull on the aggregate."""
from __future__ import annotations

import numpy as np

from ._errors import AggregationError
from ._kernels import chunks
from ._validate import NonFinite, as_updates, raise_nonfinite

__all__ = ["row_norms", "norm_clip", "clip_rows"]


def row_norms(updates: np.ndarray) -> np.ndarray:
    """Euclidean norm of each row, accumulated in float64, chunk by chunk."""
    x = as_updates(updates)
    try:
        return _row_norms(x)
    except NonFinite:
        raise_nonfinite(x)


def _row_norms(x: np.ndarray) -> np.ndarray:
    acc = np.zeros(x.shape[0])
    for sl in chunks(x.shape[1], x.shape[0]):
        c = x[:, sl].astype(np.float64)
        acc += np.einsum("ij,ij->i", c, c)
    if not np.isfinite(acc).all():
        raise NonFinite
    return np.sqrt(acc)


def norm_clip(updates: np.ndarray, max_norm: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scale rows with norm > max_norm (default: the median norm) down to max_norm.

    Returns (clipped updates in the input dtype, scale per row).
    """
    x = as_updates(updates)
    try:
        return clip_rows(x, max_norm)
    except NonFinite:
        raise_nonfinite(x)


def clip_rows(x: np.ndarray, max_norm: float | None) -> tuple[np.ndarray, np.ndarray]:
    """norm_clip without the error translation (the registry's guard handles NonFinite)."""
    if max_norm is not None and not (np.isfinite(max_norm) and max_norm > 0):
        raise AggregationError(f"norm_clip: max_norm must be positive, got {max_norm}")
    norms = _row_norms(x)
    c = float(np.median(norms)) if max_norm is None else float(max_norm)
    scale = np.where(norms > c, c / np.maximum(norms, np.finfo(np.float64).tiny), 1.0)
    out = np.empty_like(x)
    for sl in chunks(x.shape[1], x.shape[0]):
        out[:, sl] = x[:, sl] * scale[:, None]
    return out, scale
