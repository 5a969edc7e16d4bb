"""Column passes on several threads, and Krum from reply buffers against direct float64.

* Every result is bitwise the same whatever the worker count (blocks are fixed and
  summed in order), for arrays and for ``RowStack`` rows read from ``.npy`` bytes.
* Krum / Multi-Krum run the way the strategy runs them (rows are the clients' new
  weights in their float32 reply buffers, the global model as the Gram centre) and
  select exactly what direct float64 distances select, on near-duplicate updates
  where Flower's float32 ||a||^2 + ||b||^2 - 2ab goes negative.
* No pass holds an (n, d) float64 copy.
"""
from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest

from cloud_coordinator import aggregation as agg
from cloud_coordinator.aggregation import _kernels, _parallel
from cloud_coordinator.aggregation._rows import RowStack, npy_view
from cloud_coordinator.aggregation.distances import pairwise_sq_distances
from cloud_coordinator.aggregation.rules import krum_scores


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def replies_stack(w: np.ndarray, base: np.ndarray, cuts: tuple[int, ...] = ()) -> RowStack:
    """Rows ``w`` (float32 weights) as the strategy sees them: npy views, centred on ``base``."""
    rows = [[npy_view(_npy(np.ascontiguousarray(p)), p.dtype, p.shape) for p in np.split(r, list(cuts))]
            for r in w]
    return RowStack(rows).centered_at(base.astype(np.float64))


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """256-column chunks, 2 chunks a block: many blocks even for small d."""
    monkeypatch.setattr(_kernels, "_CHUNK_BYTES", 4096)
    monkeypatch.setattr(_parallel, "BLOCK_CHUNKS", 2)


def _with_workers(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    monkeypatch.setenv("FOGLINE_AGG_THREADS", str(k))
    assert agg.workers() == k


def test_workers_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOGLINE_AGG_THREADS", "3")
    assert agg.workers() == 3
    monkeypatch.setenv("FOGLINE_AGG_THREADS", "")
    assert 1 <= agg.workers() <= _parallel.MAX_WORKERS


@pytest.mark.parametrize("seed", [0, 1])
def test_results_do_not_depend_on_the_worker_count(seed: int, small_blocks: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    n, f, d = 13, 2, 5003
    base = rng.standard_normal(d).astype(np.float32)
    w = (base + rng.standard_normal((n, d)) * 1e-3).astype(np.float32)
    w[n - f:] = -3 * base
    stack = replies_stack(w, base, cuts=(1000, 1001, 4000))
    x = (w - base).astype(np.float32)
    alpha = rng.uniform(0.0, 1.0, n)
    alpha[[2, 5]] = 0.0
    results = []
    for k in (1, 2, 3, 5):
        _with_workers(monkeypatch, k)
        out = [_kernels.centered_gram(x), _kernels.centered_gram(stack),
               _kernels.centered_gram(x, rows=np.array([1, 4, 6]), center_row=0),
               pairwise_sq_distances(stack), _kernels.combine(stack, alpha),
               _kernels.combine(x, alpha, np.ones((1, d)), np.array([0.5]))]
        for rule in agg.RULES:
            res = agg.get_rule(rule, f).aggregate(stack, base=base.astype(np.float64))
            out += [res.update, np.asarray(res.selected)]
        results.append(out)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_failing_block_raises_in_the_caller(small_blocks: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _with_workers(monkeypatch, 3)
    x = np.random.default_rng(0).standard_normal((6, 4000))
    x[3, 3500] = np.nan  # the last block: found on a worker thread, raised here
    with pytest.raises(agg.AggregationError, match=r"rows \[3\]"):
        agg.krum(x, f=1)
    res = agg.get_rule("multi_krum", 1).aggregate(x)  # the registry rejects the row instead
    assert res.rejected[3] == "non-finite values"


def _flower_f32_sqdist(w: np.ndarray) -> np.ndarray:
    norms = np.square(w).sum(axis=1)
    return norms[:, None] + norms[None, :] - 2 * w @ w.T


def _ref_selection(w: np.ndarray, f: int, m: int) -> tuple[set[int], float]:
    """Multi-Krum's selected set from direct float64 distances, and its relative score gap."""
    s = krum_scores(agg.direct_sq_distances(w), f)
    order = np.argsort(s, kind="stable")
    gap = np.inf if m == len(s) else (s[order[m]] - s[order[m - 1]]) / max(s[order[m]], 1e-300)
    return {int(i) for i in order[:m]}, float(gap)


def near_duplicates(seed: int, n: int, f: int, d: int, spread: float, copies: int,
                    ulp_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Late-training replies: weights of norm ~10 per coordinate, updates ``spread`` wide,
    ``copies`` exact copies of row 0, ``ulp_rows`` rows one float32 ulp from row 1 in a
    few coordinates, f far Byzantine rows (all identical)."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(d) * 10).astype(np.float32)
    w = (base + rng.standard_normal((n, d)) * spread).astype(np.float32)
    for k in range(copies):
        w[2 + k] = w[0]
    for k in range(ulp_rows):
        r = 2 + copies + k
        w[r] = w[1]
        cols = rng.choice(d, size=3 + k, replace=False)
        w[r, cols] = np.nextafter(w[r, cols], np.float32(np.inf))
    w[n - f:] = base + np.float32(5.0)
    return base, w


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("spread,copies,ulp_rows", [
    (1e-5, 0, 0), (1e-6, 2, 0), (1e-6, 0, 3), (3e-6, 2, 2), (1e-4, 3, 1)])
def test_krum_from_replies_selects_what_direct_float64_selects(
        seed: int, spread: float, copies: int, ulp_rows: int, small_blocks: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _with_workers(monkeypatch, 2)
    n, f, d = 15, 3, 3001
    base, w = near_duplicates(seed, n, f, d, spread, copies, ulp_rows)
    exact = agg.direct_sq_distances(w)
    stack = replies_stack(w, base, cuts=(700, 701))
    iu = np.triu_indices(n, 1)
    ours = pairwise_sq_distances(stack)
    # float64-accurate: relative 1e-6 at worst, and exact zeros for exact copies
    np.testing.assert_allclose(ours[iu], exact[iu], rtol=1e-6, atol=0)
    assert np.all((ours[iu] == 0) == (exact[iu] == 0))
    for m in (1, 2, n - f - 1, n - f):
        want, gap = _ref_selection(w, f, m)
        rule = "krum" if m == 1 else "multi_krum"
        kw = {} if m == 1 else {"m": m}
        res = agg.get_rule(rule, f, **kw).aggregate(stack, base=base.astype(np.float64))
        dense = agg.multi_krum(w, f=f, m=m)
        if gap > 1e-9:
            assert set(res.selected) == want
            assert set(dense.selected) == want
        else:  # a genuine tie: any tied choice has the same score multiset
            s = krum_scores(exact, f)
            for got in (res.selected, dense.selected):
                assert sorted(s[list(got)]) == pytest.approx(sorted(s[list(want)]), rel=1e-9)
        picked = sorted(res.selected)
        want_update = w[picked].astype(np.float64).mean(axis=0) - base
        np.testing.assert_allclose(res.update, want_update, rtol=1e-9, atol=1e-12)


def test_the_near_duplicate_cases_break_float32_distances() -> None:
    """The cases above are the ones Flower's float32 formula gets wrong (negative distances)."""
    negative = 0
    for seed in range(8):
        _, w = near_duplicates(seed, 15, 3, 3001, 1e-6, 2, 0)
        fl = _flower_f32_sqdist(w)
        negative += int(np.sum(fl[np.triu_indices(15, 1)] < 0))
    assert negative > 0


def test_krum_from_replies_holds_no_float64_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_workers(monkeypatch, 2)
    n, f, d = 20, 4, 200_000
    base, w = near_duplicates(0, n, f, d, 1e-4, 1, 1)
    stack = replies_stack(w, base, cuts=(1000,))
    for rule, kw in (("krum", {}), ("multi_krum", {"m": 12}), ("bulyan", {})):
        a = agg.get_rule(rule, f, **kw)
        tracemalloc.start()
        try:
            a.aggregate(stack, base=base.astype(np.float64))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # an (n, d) float64 copy is 32 MB; workers' scratch blocks are 2 MB each
        assert peak < 0.3 * n * d * 8, (rule, peak)
