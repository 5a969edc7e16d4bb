"""Pre-aggregators: mix the updates before a robust rule sees them.

Mixing shrinks the spread of honest updates under heterogeneous (non-IID) data,
which is where plain robust rules fail. Each returns ``Mixed``: the new rows and,
for each row, the clients that went into it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._errors import AggregationError
from ._kernels import mix
from ._result import count, positive
from ._validate import NonFinite, as_updates, check_f, raise_nonfinite
from .distances import pairwise_sq_distances

__all__ = ["PRE_OPTIONS", "Mixed", "nnm", "bucketing", "nnm_matrix", "bucketing_matrix", "groups_of"]


# The pre-aggregators a pipeline may put before its rule (``nnm+trimmed_mean``), each with its options'
# checks (``clip`` is ``clipping.clip_rows``).
PRE_OPTIONS: dict[str, dict[str, Callable[[object], bool]]] = {
    "nnm": {},
    "bucketing": {"bucket_size": count},
    "clip": {"clip_norm": lambda v: v is None or positive(v)},
}


@dataclass(frozen=True, slots=True, eq=False)
class Mixed:
    """Mixed updates (k, d), in the input dtype, and the clients behind each row."""

    updates: np.ndarray
    groups: tuple[tuple[int, ...], ...]


def groups_of(mat: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """For each mixed row, the clients with a non-zero coefficient."""
    return tuple(tuple(int(j) for j in np.flatnonzero(row)) for row in mat)


def nnm_matrix(dist: np.ndarray, f: int) -> np.ndarray:
    """Row i averages the n - f nearest updates to update i (itself included)."""
    n = dist.shape[0]
    check_f("nnm", n, f, f + 1)
    mat = np.zeros((n, n))
    k = n - f
    d = dist.copy()
    np.fill_diagonal(d, -1.0)  # self first, whatever the ties
    for i in range(n):
        nbrs = np.argsort(d[i], kind="stable")[:k]
        mat[i, nbrs] = 1.0 / k
    return mat


def nnm(updates: np.ndarray, *, f: int) -> Mixed:
    """Nearest neighbour mixing (Allouah et al. 2023); exact distances, chunked mixing."""
    x = as_updates(updates)
    try:
        mat = nnm_matrix(pairwise_sq_distances(x), f)
        mixed = mix(x, mat)
    except NonFinite:
        raise_nonfinite(x)
    return Mixed(mixed, groups_of(mat))


def bucketing_matrix(n: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """Random partition into buckets of s (the last may be smaller); row = bucket mean."""
    if not isinstance(s, (int, np.integer)) or s < 1:
        raise AggregationError(f"bucketing: bucket size s must be a positive integer, got {s!r}")
    perm = rng.permutation(n)
    k = -(-n // s)
    mat = np.zeros((k, n))
    for b in range(k):
        members = perm[b * s: (b + 1) * s]
        mat[b, members] = 1.0 / members.size
    return mat


def bucketing(updates: np.ndarray, *, s: int = 2, rng: np.random.Generator) -> Mixed:
    """Bucketing (Karimireddy, He and Jaggi 2022): means of random buckets of s updates."""
    x = as_updates(updates)
    mat = bucketing_matrix(x.shape[0], s, rng)
    try:
        mixed = mix(x, mat)
    except NonFinite:
        raise_nonfinite(x)
    return Mixed(mixed, groups_of(mat))
