"""Aggregation rules over stacked client updates (n, d) -> one (d,) update.

Each public rule validates its arguments, detects NaN/Inf inside its own passes
(``reject_nonfinite=True`` drops those clients and reports them in ``rejected``;
otherwise it raises ``AggregationError``) and returns an ``AggregateResult``.
Coordinate-wise rules (median, trimmed mean, Bulyan's second stage) ignore
weights, as in their papers; mean, Multi-Krum, geometric median and centred
clipping honour them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import AggregationError
from ._kernels import centered_gram, combine, map_sorted_chunks, map_sorted_rows
from ._result import AggregateResult, RuleSpec, count, positive
from ._validate import as_updates, as_weights, check_f, guarded
from .distances import pairwise_sq_distances

__all__ = [
    "SPECS", "mean", "coordinate_median", "trimmed_mean", "krum", "multi_krum", "bulyan",
    "geometric_median", "centered_clipping", "krum_scores",
]

NOT_SELECTED = "not selected"


def _all(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def _mean_core(x: np.ndarray, w: np.ndarray | None, *, f: int = 0) -> AggregateResult:
    """Core of ``mean`` (raises NonFinite; the guard handles it)."""
    check_f("mean", x.shape[0], f, 1)
    return AggregateResult(combine(x, as_weights(w, x.shape[0])), _all(x.shape[0]))


def mean(updates: np.ndarray, *, f: int = 0, weights: np.ndarray | None = None,
         reject_nonfinite: bool = False) -> AggregateResult:
    """Weighted mean (FedAvg); not robust, the baseline every rule is measured against."""
    x = as_updates(updates)
    return guarded(lambda x, w: _mean_core(x, w, f=f), x, weights, reject_nonfinite)


MEAN = RuleSpec("mean", _mean_core, mean, lambda f: 1)


def _coordinate_median_core(x: np.ndarray, w: np.ndarray | None, *,
                            f: int = 0) -> AggregateResult:
    """Core of ``coordinate_median`` (raises NonFinite; the guard handles it)."""
    n, d = x.shape
    check_f("median", n, f, 2 * f + 1)
    out = np.empty(d)
    lo, hi = (n - 1) // 2, n // 2

    def each(sl: slice, a: np.ndarray) -> None:
        out[sl] = a[:, lo]
        if hi != lo:
            out[sl] += a[:, hi]
            out[sl] *= 0.5
    map_sorted_chunks(x, each)
    return AggregateResult(out, _all(n))


def coordinate_median(updates: np.ndarray, *, f: int = 0, weights: np.ndarray | None = None,
                      reject_nonfinite: bool = False) -> AggregateResult:
    """Per-coordinate median (Yin et al. 2018); tolerates f < n / 2."""
    x = as_updates(updates)
    return guarded(lambda x, w: _coordinate_median_core(x, w, f=f), x, weights, reject_nonfinite)


MEDIAN = RuleSpec("median", _coordinate_median_core, coordinate_median, lambda f: 2 * f + 1)


def _trimmed_mean_core(x: np.ndarray, w: np.ndarray | None, *, f: int) -> AggregateResult:
    """Core of ``trimmed_mean`` (raises NonFinite; the guard handles it)."""
    n, d = x.shape
    check_f("trimmed_mean", n, f, 2 * f + 1)
    out = np.empty(d)
    keep = n - 2 * f

    def each(sl: slice, a: np.ndarray) -> None:
        out[sl] = a[:, f: n - f].sum(axis=1, dtype=np.float64)
    map_sorted_chunks(x, each)
    out /= keep
    return AggregateResult(out, _all(n))


def trimmed_mean(updates: np.ndarray, *, f: int, weights: np.ndarray | None = None,
                 reject_nonfinite: bool = False) -> AggregateResult:
    """Per coordinate, drop the f largest and f smallest values and average the rest."""
    x = as_updates(updates)
    return guarded(lambda x, w: _trimmed_mean_core(x, w, f=f), x, weights, reject_nonfinite)


TRIMMED_MEAN = RuleSpec("trimmed_mean", _trimmed_mean_core, trimmed_mean, lambda f: 2 * f + 1)


def krum_scores(dist: np.ndarray, f: int, active: np.ndarray | None = None) -> np.ndarray:
    """Krum score of each active row: sum of squared distances to its m - f - 2 nearest.

    m is the number of active rows; when m - f - 2 < 1 (late in Bulyan's selection)
    one neighbour is used, the smallest meaningful neighbourhood.
    """
    idx = np.arange(dist.shape[0]) if active is None else active
    sub = dist[np.ix_(idx, idx)].copy()
    m = idx.size
    if m == 1:
        return np.zeros(1)
    np.fill_diagonal(sub, np.inf)
    k = max(1, m - f - 2)
    scores: np.ndarray = np.partition(sub, k - 1, axis=1)[:, :k].sum(axis=1)
    return scores


def _rejected(n: int, selected: tuple[int, ...], reason: str) -> dict[int, str]:
    chosen = set(selected)
    return {i: reason for i in range(n) if i not in chosen}


def _multi_krum_core(x: np.ndarray, w: np.ndarray | None, *, f: int,
                     m: int | None = None) -> AggregateResult:
    """Core of ``multi_krum`` (raises NonFinite; the guard handles it)."""
    n = x.shape[0]
    check_f("krum", n, f, 2 * f + 3)
    mm = n - f if m is None else m
    if not 1 <= mm <= n:
        raise AggregationError(f"multi_krum: m must be in [1, {n}], got {mm}")
    scores = krum_scores(pairwise_sq_distances(x), f)
    order = np.argsort(scores, kind="stable")[:mm]
    sel = tuple(sorted(int(i) for i in order))
    if mm == 1:
        out = x[sel[0]].astype(np.float64)
    else:
        ww = np.zeros(n)
        base = np.ones(n) if w is None else w
        ww[list(sel)] = base[list(sel)]
        out = combine(x, as_weights(ww, n))
    return AggregateResult(out, sel, _rejected(n, sel, NOT_SELECTED))


def krum(updates: np.ndarray, *, f: int, weights: np.ndarray | None = None,
         reject_nonfinite: bool = False) -> AggregateResult:
    """Krum (Blanchard et al. 2017): the update with the lowest score; needs n >= 2f + 3."""
    return multi_krum(updates, f=f, m=1, weights=weights, reject_nonfinite=reject_nonfinite)


def _krum_core(x: np.ndarray, w: np.ndarray | None, *, f: int) -> AggregateResult:
    """Core of ``krum``."""
    return _multi_krum_core(x, w, f=f, m=1)


KRUM = RuleSpec("krum", _krum_core, krum, lambda f: 2 * f + 3)


def multi_krum(updates: np.ndarray, *, f: int, m: int | None = None,
               weights: np.ndarray | None = None,
               reject_nonfinite: bool = False) -> AggregateResult:
    """Multi-Krum: weighted mean of the m lowest-scoring updates (default m = n - f)."""
    x = as_updates(updates)
    return guarded(lambda x, w: _multi_krum_core(x, w, f=f, m=m), x, weights, reject_nonfinite)


MULTI_KRUM = RuleSpec("multi_krum", _multi_krum_core, multi_krum, lambda f: 2 * f + 3,
                      {"m": lambda v: v is None or count(v)})


def _bulyan_core(x: np.ndarray, w: np.ndarray | None, *, f: int) -> AggregateResult:
    """Core of ``bulyan`` (raises NonFinite; the guard handles it)."""
    n, d = x.shape
    check_f("bulyan", n, f, 4 * f + 3)
    dist = pairwise_sq_distances(x)
    remaining = list(range(n))
    picked: list[int] = []
    theta = n - 2 * f
    while len(picked) < theta:
        scores = krum_scores(dist, f, np.asarray(remaining))
        best = remaining[int(np.argmin(scores))]
        picked.append(best)
        remaining.remove(best)
    beta = theta - 2 * f
    rows = np.asarray(sorted(picked))
    out = np.empty(d)
    lo, hi = (theta - 1) // 2, theta // 2
    two_f = 2 * f
    windows = np.zeros((two_f + 1, theta))
    for s0 in range(two_f + 1):
        windows[s0, s0: s0 + beta] = 1.0

    def each(sl: slice, a32: np.ndarray) -> None:
        # float64: sums of two float32 values are exact there, so near-equidistant values are
        # told apart exactly (in float32 the sums round and pick the wrong window).
        a = a32.astype(np.float64)
        med2 = a[lo] + a[hi]  # twice the median
        # The window slides up while the value just above it is closer to the
        # median than its lowest value; that test is monotone in the start s, so
        # the start is the number of s in [0, 2f) where it holds.
        start = (a[:two_f] + a[beta: beta + two_f] < med2).sum(axis=0)
        sums = windows @ a  # every candidate window's sum, one gemm
        out[sl] = np.take_along_axis(sums, start[None, :], axis=0)[0]
    map_sorted_rows(x, rows, each)
    out /= beta
    sel = tuple(int(i) for i in rows)
    return AggregateResult(out, sel, _rejected(n, sel, NOT_SELECTED))


def bulyan(updates: np.ndarray, *, f: int, weights: np.ndarray | None = None,
           reject_nonfinite: bool = False) -> AggregateResult:
    """Bulyan (El Mhamdi et al. 2018) over Krum; needs n >= 4f + 3.

    Stage 1 picks theta = n - 2f updates by iterated Krum, each time over the
    updates not yet picked. Stage 2 returns, per coordinate, the mean of the
    beta = theta - 2f picked values closest to their median. Those values form a
    window of beta consecutive sorted values, so stage 2 is one sort per chunk, a
    vectorised count that finds the window, and one small gemm for the sums.
    """
    x = as_updates(updates)
    return guarded(lambda x, w: _bulyan_core(x, w, f=f), x, weights, reject_nonfinite)


BULYAN = RuleSpec("bulyan", _bulyan_core, bulyan, lambda f: 4 * f + 3)


def _affine_sqdist(g: np.ndarray, alpha: np.ndarray, rows: int) -> np.ndarray:
    """Squared distance from the point alpha (affine combination) to rows 0..rows-1."""
    ga = g @ alpha
    val = float(alpha @ ga) - 2.0 * ga[:rows] + np.diag(g)[:rows]
    out: np.ndarray = np.maximum(val, 0.0)
    return out


def _geometric_median_core(x: np.ndarray, w: np.ndarray | None, *, f: int = 0, tol: float = 1e-7,
                           max_iter: int = 200, nu: float = 1e-9) -> AggregateResult:
    """Core of ``geometric_median`` (raises NonFinite; the guard handles it)."""
    n = x.shape[0]
    check_f("geometric_median", n, f, 2 * f + 1)
    ww = as_weights(w, n)
    g = centered_gram(x)
    spread = float(np.sqrt(max(np.trace(g) / n, 0.0)))
    floor = max(nu * spread, np.finfo(np.float64).tiny)
    alpha = ww.copy()
    for _ in range(max_iter):
        r = np.sqrt(_affine_sqdist(g, alpha, n))
        beta = ww / np.maximum(r, floor)
        new = beta / beta.sum()
        step = new - alpha
        moved = float(np.sqrt(max(step @ g @ step, 0.0)))
        alpha = new
        if moved <= tol * max(spread, floor):
            break
    return AggregateResult(combine(x, alpha), _all(n))


def geometric_median(updates: np.ndarray, *, f: int = 0, weights: np.ndarray | None = None,
                     tol: float = 1e-7, max_iter: int = 200, nu: float = 1e-9,
                     reject_nonfinite: bool = False) -> AggregateResult:
    """Weighted geometric median by smoothed Weiszfeld (Pillutla et al. 2022, RFA).

    The iterate is an affine combination of the updates, so every iteration runs on
    the n x n Gram matrix; the data is read twice in total. Stops when a step moves
    less than ``tol`` times the updates' RMS spread.
    """
    x = as_updates(updates)
    return guarded(
        lambda x, w: _geometric_median_core(x, w, f=f, tol=tol, max_iter=max_iter, nu=nu),
        x, weights, reject_nonfinite)


GEOMETRIC_MEDIAN = RuleSpec("geometric_median", _geometric_median_core, geometric_median, lambda f: 2 * f + 1,
                            {"tol": positive, "max_iter": count, "nu": positive})


def _centered_clipping_core(x: np.ndarray, w: np.ndarray | None, *, f: int = 0,
                            state: Mapping[str, Any] | None = None, tau: float | None = None,
                            iters: int = 3, quantile: float = 0.5) -> AggregateResult:
    """Core of ``centered_clipping`` (raises NonFinite; the guard handles it)."""
    n, d = x.shape
    check_f("centered_clipping", n, f, 2 * f + 1)
    ww = as_weights(w, n)
    v0 = None if state is None else state.get("v")
    if v0 is not None:
        v0 = np.asarray(v0, dtype=np.float64)
        if v0.shape != (d,):
            raise AggregationError(
                f"centered_clipping: state v has shape {v0.shape}, updates have d={d}")
    extra = np.zeros((1, d)) if v0 is None else v0[None, :]
    g = centered_gram(x, extra)
    alpha = np.zeros(n + 1)
    alpha[n] = 1.0
    radius = tau
    for _ in range(iters):
        r = np.sqrt(_affine_sqdist(g, alpha, n))
        if radius is None:
            radius = float(np.quantile(r, quantile))
        lam = ww * np.minimum(1.0, radius / np.maximum(r, np.finfo(np.float64).tiny))
        if radius == 0.0:
            lam = np.zeros(n)
        alpha *= 1.0 - lam.sum()
        alpha[:n] += lam
    out = combine(x, alpha[:n], extra, alpha[n:])
    return AggregateResult(out, _all(n), state={"v": out.copy()})


def centered_clipping(updates: np.ndarray, *, f: int = 0, weights: np.ndarray | None = None,
                      state: Mapping[str, Any] | None = None, tau: float | None = None,
                      iters: int = 3, quantile: float = 0.5,
                      reject_nonfinite: bool = False) -> AggregateResult:
    """Centred clipping (Karimireddy, He and Jaggi 2021), started from last round's result.

    v <- v + sum_i w_i clip_tau(x_i - v), ``iters`` times, from the previous
    aggregate (``state["v"]``; zero in round one). When ``tau`` is None the radius
    is the ``quantile`` (default median) of the updates' distances from the starting
    point, so honest updates pass mostly unclipped while each Byzantine update moves v by at most
    w_i * tau per iteration. All iterations run on the Gram matrix of [x; v0].
    """
    x = as_updates(updates)
    if iters < 1:
        raise AggregationError(f"centered_clipping: iters must be >= 1, got {iters}")
    if tau is not None and not (np.isfinite(tau) and tau > 0):
        raise AggregationError(f"centered_clipping: tau must be positive, got {tau}")
    if not 0.0 < quantile <= 1.0:
        raise AggregationError(f"centered_clipping: quantile must be in (0, 1], got {quantile}")
    return guarded(
        lambda x, w: _centered_clipping_core(x, w, f=f, state=state, tau=tau, iters=iters,
                                             quantile=quantile),
        x, weights, reject_nonfinite)


def _fraction(v: object) -> bool:
    return positive(v) and float(v) <= 1  # type: ignore[arg-type]  # positive: a real number


CENTERED_CLIPPING = RuleSpec(
    "centered_clipping", _centered_clipping_core, centered_clipping, lambda f: 2 * f + 1,
    {"tau": lambda v: v is None or positive(v), "iters": count, "quantile": _fraction}, stateful=True)

# Every rule by registry name, in the order the CLI lists them: the registry runs their unguarded cores
# under its own guard (it sees NonFinite from pre-aggregation and the rule alike, so it can drop those
# clients and rerun). A new rule is its core, its guarded function and its spec above, listed here.
SPECS: tuple[RuleSpec, ...] = (MEAN, MEDIAN, TRIMMED_MEAN, KRUM, MULTI_KRUM, BULYAN, GEOMETRIC_MEDIAN,
                               CENTERED_CLIPPING)
