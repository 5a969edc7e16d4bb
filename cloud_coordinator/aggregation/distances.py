"""Exact pairwise squared distances between client updates.

Flower computes ||a||^2 + ||b||^2 - 2ab in float32 on raw weights; late in training,
when updates are close relative to their norms, that formula cancels
catastrophically. Here the Gram matrix is taken of centred rows in float64, every
pair whose conditioning (||a||^2 + ||b||^2) / d(a, b)^2 still exceeds
``KAPPA_MAX`` is recomputed directly, and if many pairs are ill-conditioned (one
identical Byzantine copies; or one far outlier drags the mean away) each group of
mutually ill-conditioned rows is re-centred on one of its members and its Gram
recomputed; what is still ill-conditioned then is computed directly.
"""
from __future__ import annotations

import numpy as np

from ._kernels import centered_gram, chunks, gram_to_sqdist
from ._rows import RowStack
from ._validate import NonFinite, as_updates

__all__ = ["pairwise_sq_distances", "direct_sq_distances", "KAPPA_MAX"]

# Relative error of a Gram-derived distance is about eps64 * growth * kappa; with a
# pessimistic growth of 1e3 (long dot products) kappa 1e4 stays below 1e-8.
KAPPA_MAX = 1e4


def _ill_conditioned(g: np.ndarray, dist: np.ndarray) -> np.ndarray:
    sq = np.diag(g)
    scale = sq[:, None] + sq[None, :]
    bad = scale > KAPPA_MAX * dist
    np.fill_diagonal(bad, False)
    return np.triu(bad)


def _direct_pairs(x: np.ndarray, pairs: np.ndarray, dist: np.ndarray) -> None:
    """Overwrite dist[i, j] for the given (i, j) pairs with sum((x_i - x_j)^2)."""
    for i in np.unique(pairs[:, 0]):
        js = pairs[pairs[:, 0] == i, 1]
        acc = np.zeros(js.size)
        for sl in chunks(x.shape[1], js.size + 1):
            diff = x[js, sl].astype(np.float64)
            diff -= x[i, sl]
            acc += np.einsum("ij,ij->i", diff, diff)
        dist[i, js] = acc
        dist[js, i] = acc
    if not np.isfinite(dist).all():
        raise NonFinite


def _components(n: int, pairs: np.ndarray) -> list[np.ndarray]:
    """Connected components (size >= 2) of the graph with the given edges."""
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i, j in pairs:
        parent[find(int(i))] = find(int(j))
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return [np.asarray(g) for g in groups.values() if len(g) > 1]


def _rows_equal(x: np.ndarray, i: int, j: int) -> bool:
    """Bitwise equality of rows i and j, chunk by chunk, stopping at the first difference."""
    for sl in chunks(x.shape[1], 2):
        if isinstance(x, RowStack):  # compare the reply buffers in place: no gathered copies
            pa, pb = x.pieces(i, sl.start, sl.stop), x.pieces(j, sl.start, sl.stop)
            if not all(np.array_equal(a, b) for a, b in zip(pa, pb, strict=True)):
                return False
        elif not np.array_equal(x[i, sl], x[j, sl]):
            return False
    return True


def _dedupe(x: np.ndarray, comp: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
    """Split rows into distinct representatives and exact copies (row -> its original).

    Byzantine clients often send one vector many times; a bitwise comparison
    settles those pairs (distance exactly 0). One gathered prefix per row rules out
    almost every pair before a full comparison is made.
    """
    prefix = x[comp, 0:min(x.shape[1], 4096)]
    reps: list[int] = []
    alias: dict[int, int] = {}
    for k, i in enumerate(comp):
        for r in reps:
            if np.array_equal(prefix[k], prefix[int(np.flatnonzero(comp == r)[0])]) and _rows_equal(x, int(i), r):
                alias[int(i)] = r
                break
        else:
            reps.append(int(i))
    return np.asarray(reps), alias


def pairwise_sq_distances(updates: np.ndarray) -> np.ndarray:
    """(n, n) squared Euclidean distances, within 1e-6 relative of exact float64."""
    x = as_updates(updates)
    n = x.shape[0]
    g = centered_gram(x)
    dist = gram_to_sqdist(g)
    bad = _ill_conditioned(g, dist)
    if bad.any():
        for comp in _components(n, np.argwhere(bad)):
            reps, alias = _dedupe(x, comp)
            if reps.size > 1:
                gc = centered_gram(x, rows=reps, center_row=0)
                dc = gram_to_sqdist(gc)
                dist[np.ix_(reps, reps)] = dc
                still = np.argwhere(_ill_conditioned(gc, dc))
                if still.size:
                    _direct_pairs(x, reps[still], dist)
            for i, r in alias.items():  # exact copies: same distances as their original
                dist[i, :] = dist[r, :]
                dist[:, i] = dist[:, r]
            for i, r in alias.items():
                dist[i, r] = dist[r, i] = 0.0
                for j, q in alias.items():
                    if q == r:
                        dist[i, j] = 0.0
    return dist


def direct_sq_distances(updates: np.ndarray) -> np.ndarray:
    """Reference: sum((x_i - x_j)^2) row pair by row pair in float64 (slow, exact)."""
    x = as_updates(updates)
    n = x.shape[0]
    dist = np.zeros((n, n))
    pairs = np.array([(i, j) for i in range(n) for j in range(i + 1, n)], dtype=np.intp)
    if pairs.size:
        _direct_pairs(x, pairs.reshape(-1, 2), dist)
    return dist
