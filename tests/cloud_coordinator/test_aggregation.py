"""Aggregation rules against slow reference implementations written from the papers."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_coordinator import aggregation as agg
from cloud_coordinator.aggregation import _kernels

# --------------------------------------------------------------------------- references


def ref_dist(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return np.array([[float(np.sum((a - b) ** 2)) for b in x] for a in x])


def ref_scores(dist: np.ndarray, rows: list[int], f: int) -> list[float]:
    k = max(1, len(rows) - f - 2)
    return [sum(sorted(dist[i, j] for j in rows if j != i)[:k]) for i in rows]


def ref_krum(x: np.ndarray, f: int) -> np.ndarray:
    s = ref_scores(ref_dist(x), list(range(len(x))), f)
    return x[int(np.argmin(s))].astype(np.float64)


def ref_multi_krum(x: np.ndarray, f: int, m: int) -> np.ndarray:
    s = ref_scores(ref_dist(x), list(range(len(x))), f)
    return x[np.argsort(s, kind="stable")[:m]].astype(np.float64).mean(axis=0)


def ref_bulyan(x: np.ndarray, f: int) -> np.ndarray:
    n = len(x)
    theta, dist = n - 2 * f, ref_dist(x)
    beta = theta - 2 * f
    rest, picked = list(range(n)), []
    for _ in range(theta):
        best = rest[int(np.argmin(ref_scores(dist, rest, f)))]
        picked.append(best)
        rest.remove(best)
    s = x[picked].astype(np.float64)
    med = np.median(s, axis=0)
    out = np.empty(x.shape[1])
    for c in range(x.shape[1]):
        idx = np.argsort(np.abs(s[:, c] - med[c]), kind="stable")[:beta]
        out[c] = s[idx, c].mean()
    return out


def ref_trimmed(x: np.ndarray, f: int) -> np.ndarray:
    s = np.sort(x.astype(np.float64), axis=0)
    return s[f: len(x) - f].mean(axis=0)


def ref_gm(x: np.ndarray, w: np.ndarray, iters: int = 2000) -> np.ndarray:
    x = x.astype(np.float64)
    z = w @ x / w.sum()
    for _ in range(iters):
        r = np.maximum(np.linalg.norm(x - z, axis=1), 1e-12)
        z = (w / r) @ x / np.sum(w / r)
    return z


def ref_cc(x: np.ndarray, v0: np.ndarray, iters: int, tau: float | None) -> np.ndarray:
    x = x.astype(np.float64)
    v = v0.copy()
    n = len(x)
    t = tau
    for _ in range(iters):
        r = np.linalg.norm(x - v, axis=1)
        if t is None:
            t = float(np.median(r))
        v = v + sum(min(1.0, t / r[i]) * (x[i] - v) for i in range(n) if r[i] > 0) / n
    return v


def honest_and_byzantine(n: int, f: int, d: int, seed: int, scale: float = 100.0,
                         dtype: type = np.float64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 0.1, (n, d))
    x[n - f:] = rng.normal(-scale, scale, (f, d))
    return x.astype(dtype)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force many 256-column chunks so chunk boundaries are exercised."""
    monkeypatch.setattr(_kernels, "_CHUNK_BYTES", 4096)


# --------------------------------------------------------------------------- known answers

CASES = [(7, 1, 5, 0), (11, 2, 37, 1), (15, 3, 600, 2), (19, 4, 33, 3), (23, 5, 300, 4)]


@pytest.mark.parametrize("n,f,d,seed", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rules_match_references(n: int, f: int, d: int, seed: int, dtype: type,
                                small_chunks: None) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(dtype)
    rtol = 1e-5 if dtype is np.float32 else 1e-10
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(agg.mean(x).update, x64.mean(axis=0), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(agg.coordinate_median(x).update, np.median(x64, axis=0),
                               rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(agg.trimmed_mean(x, f=f).update, ref_trimmed(x, f), rtol=rtol,
                               atol=1e-7)
    np.testing.assert_array_equal(agg.krum(x, f=f).update, ref_krum(x, f))
    m = n - f
    np.testing.assert_allclose(agg.multi_krum(x, f=f, m=m).update, ref_multi_krum(x, f, m),
                               rtol=rtol, atol=1e-7)
    if n >= 4 * f + 3:
        np.testing.assert_allclose(agg.bulyan(x, f=f).update, ref_bulyan(x, f), rtol=rtol,
                                   atol=1e-7)


@pytest.mark.parametrize("n,d,seed", [(5, 3, 0), (9, 40, 1), (16, 300, 2)])
def test_geometric_median_matches_weiszfeld(n: int, d: int, seed: int, small_chunks: None) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    w = rng.uniform(0.5, 2.0, n)
    got = agg.geometric_median(x, weights=w, tol=1e-12, max_iter=5000).update
    want = ref_gm(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    obj = lambda z: float(w @ np.linalg.norm(x - z, axis=1))  # noqa: E731
    assert obj(got) <= obj(want) * (1 + 1e-9)


@pytest.mark.parametrize("iters,tau", [(1, None), (3, None), (5, 0.5)])
def test_centered_clipping_matches_reference(iters: int, tau: float | None,
                                             small_chunks: None) -> None:
    rng = np.random.default_rng(iters)
    x = rng.standard_normal((10, 300))
    v0 = rng.standard_normal(300) * 0.1
    res = agg.centered_clipping(x, state={"v": v0}, iters=iters, tau=tau)
    np.testing.assert_allclose(res.update, ref_cc(x, v0, iters, tau), rtol=1e-9, atol=1e-12)
    assert res.state is not None
    np.testing.assert_array_equal(res.state["v"], res.update)
    first = agg.centered_clipping(x, iters=iters, tau=tau)  # round one starts from zero
    np.testing.assert_allclose(first.update, ref_cc(x, np.zeros(300), iters, tau), rtol=1e-9,
                               atol=1e-12)


def test_nnm_mixes_nearest_neighbours() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 20))
    f = 2
    mixed = agg.nnm(x, f=f)
    dist = ref_dist(x)
    for i in range(9):
        nbrs = np.argsort(dist[i], kind="stable")[: 9 - f]
        np.testing.assert_allclose(mixed.updates[i], x[nbrs].mean(axis=0), rtol=1e-12)
        assert set(mixed.groups[i]) == {int(j) for j in nbrs}


def test_bucketing_is_a_partition_into_bucket_means() -> None:
    x = np.arange(7 * 4, dtype=np.float64).reshape(7, 4)
    mixed = agg.bucketing(x, s=3, rng=np.random.default_rng(0))
    assert sorted(c for g in mixed.groups for c in g) == list(range(7))
    assert [len(g) for g in mixed.groups] == [3, 3, 1]
    for row, g in zip(mixed.updates, mixed.groups):
        np.testing.assert_allclose(row, x[list(g)].mean(axis=0))


def test_norm_clip() -> None:
    x = np.array([[3.0, 4.0], [0.3, 0.4], [30.0, 40.0]])
    out, scale = agg.norm_clip(x, max_norm=5.0)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), [5.0, 0.5, 5.0])
    np.testing.assert_allclose(scale, [1.0, 1.0, 0.1])
    out, _ = agg.norm_clip(x)  # default radius: the median norm
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), [5.0, 0.5, 5.0])


# --------------------------------------------------------------------------- exactness


def _max_rel(got: np.ndarray, want: np.ndarray) -> float:
    iu = np.triu_indices(len(want), 1)
    return float(np.max(np.abs(got[iu] - want[iu]) / want[iu]))


@pytest.mark.parametrize(
    "base_scale,noise,dtype",
    [(1.0, 1e-4, np.float32), (1.0, 1e-3, np.float32), (10.0, 1e-8, np.float64),
     (1.0, 1e-12, np.float64)],
)
def test_distances_exact_on_near_identical_updates(base_scale: float, noise: float,
                                                   dtype: type, small_chunks: None) -> None:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(4000) * base_scale
    x = (base + rng.standard_normal((12, 4000)) * noise).astype(dtype)
    want = agg.direct_sq_distances(x)
    assert _max_rel(agg.pairwise_sq_distances(x), want) < 1e-6
    # Sanity: the textbook Gram formula in the input precision (what Flower does)
    # really is inaccurate on these rows.
    sq = np.einsum("ij,ij->i", x, x)
    naive = (sq[:, None] + sq[None, :] - 2 * x @ x.T).astype(np.float64)
    assert _max_rel(naive, want) > 1e-6


def test_distances_exact_with_far_outlier_and_duplicates(small_chunks: None) -> None:
    rng = np.random.default_rng(1)
    honest = 5.0 + rng.standard_normal((10, 2000)) * 1e-5
    byz = np.full((4, 2000), 1e7)
    x = np.vstack([honest, byz, honest[:2]])  # far identical outliers + exact honest copies
    got = agg.pairwise_sq_distances(x)
    want = ref_dist(x)
    nz = want > 0
    assert np.all(got[~nz] == 0.0)
    assert np.max(np.abs(got[nz] - want[nz]) / want[nz]) < 1e-6


def test_direct_distances_match_naive_loop() -> None:
    x = np.random.default_rng(2).standard_normal((6, 50))
    np.testing.assert_allclose(agg.direct_sq_distances(x), ref_dist(x), rtol=1e-12)


# --------------------------------------------------------------------------- robustness

ROBUST = ["median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median",
          "centered_clipping", "nnm+trimmed_mean", "nnm+centered_clipping",
          "bucketing+geometric_median"]


@pytest.mark.parametrize("name", ROBUST)
def test_byzantine_outliers_are_filtered(name: str) -> None:
    n, f, d = 23, 5, 50
    x = honest_and_byzantine(n, f, d, seed=4)
    honest_mean = x[: n - f].mean(axis=0)
    bad = agg.get_rule("mean", f).aggregate(x).update
    assert np.linalg.norm(bad - honest_mean) > 50
    a = agg.get_rule(name, f, seed=0)
    for _ in range(3):  # centred clipping needs a few rounds to walk from zero
        got = a.aggregate(x).update
    assert np.linalg.norm(got - honest_mean) < 0.2 * np.linalg.norm(honest_mean)


def test_krum_rejects_the_byzantine_rows() -> None:
    x = honest_and_byzantine(13, 3, 20, seed=5)
    res = agg.multi_krum(x, f=3)
    assert set(res.selected) == set(range(10))
    assert res.rejected == {10: "not selected", 11: "not selected", 12: "not selected"}


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: agg.krum(x, f=3), r"krum: needs n >= 9"),
        (lambda x: agg.bulyan(x, f=2), r"bulyan: needs n >= 11"),
        (lambda x: agg.trimmed_mean(x, f=4), r"needs n >= 9"),
        (lambda x: agg.krum(x, f=-1), r"non-negative integer"),
        (lambda x: agg.mean(x, weights=np.ones(3)), r"weights must have shape \(8,\)"),
        (lambda x: agg.mean(x, weights=-np.ones(8)), r"non-negative"),
        (lambda x: agg.mean(x[0]), r"2-D array"),
        (lambda x: agg.mean(x.astype(str)), r"numeric"),
        (lambda x: agg.multi_krum(x, f=1, m=0), r"m must be in"),
        (lambda x: agg.centered_clipping(x, iters=0), r"iters"),
        (lambda x: agg.centered_clipping(x, state={"v": np.zeros(3)}), r"state v has shape"),
        (lambda x: agg.get_rule("krumm", 1), r"unknown aggregation rule 'krumm'"),
        (lambda x: agg.get_rule("foo+krum", 1), r"unknown pre-aggregator 'foo'"),
        (lambda x: agg.get_rule("krum", 1, m=3), r"unknown options \['m'\]"),
        (lambda x: agg.get_rule("centered_clipping", 1, quantile=2.0), r"option quantile"),
        (lambda x: agg.get_rule("bucketing+mean", 1, bucket_size=0), r"option bucket_size"),
        (lambda x: agg.get_rule("clip+mean", 1, clip_norm=-1.0), r"option clip_norm"),
    ],
)
def test_invalid_arguments_raise_clear_errors(call, match: str) -> None:  # type: ignore
    x = np.random.default_rng(0).standard_normal((8, 5))
    with pytest.raises(agg.AggregationError, match=match):
        call(x)


def test_aggregation_error_is_a_value_error() -> None:
    from runtime.errors import FoglineError

    assert issubclass(agg.AggregationError, ValueError)
    assert issubclass(agg.AggregationError, FoglineError)


@pytest.mark.parametrize("name", agg.RULES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_rows_raise_or_are_rejected(name: str, bad: float, small_chunks: None) -> None:
    x = np.random.default_rng(1).standard_normal((15, 700))
    x[4, 650] = bad
    x[9, 3] = bad
    fn = getattr(agg, {"median": "coordinate_median"}.get(name, name))
    with pytest.raises(agg.AggregationError, match=r"rows \[4, 9\]"):
        fn(x, f=2)
    res = agg.get_rule(name, 2).aggregate(x)
    assert res.rejected[4] == res.rejected[9] == "non-finite values"
    assert np.isfinite(res.update).all()
    assert 4 not in res.selected and 9 not in res.selected
    clean = agg.get_rule(name, 2).aggregate(np.delete(x, [4, 9], axis=0)).update
    np.testing.assert_allclose(res.update, clean)


# --------------------------------------------------------------------------- registry / state


def test_registry_names_build_and_run() -> None:
    x = np.random.default_rng(2).standard_normal((15, 30)).astype(np.float32)
    for name in agg.RULES:
        res = agg.get_rule(name, 2).aggregate(x)
        assert res.update.shape == (30,) and res.update.dtype == np.float64
    for pre in agg.PREAGGREGATORS:
        res = agg.get_rule(f"{pre}+geometric_median", 2).aggregate(x)
        assert np.isfinite(res.update).all()
    assert agg.describe("nnm+bulyan") == "nnm -> bulyan"
    assert agg.robust_default(2).name == agg.DEFAULT_RULE


@pytest.mark.parametrize("name", ["centered_clipping", "bucketing+centered_clipping",
                                  "nnm+centered_clipping", "bucketing+krum", agg.DEFAULT_RULE])
def test_state_round_trip_resumes_identically(name: str) -> None:
    rng = np.random.default_rng(7)
    rounds = [rng.standard_normal((15, 40)) + 0.5 for _ in range(5)]
    straight = agg.get_rule(name, 2, seed=11)
    want = [straight.aggregate(r).update for r in rounds]

    first = agg.get_rule(name, 2, seed=11)
    for r in rounds[:2]:
        first.aggregate(r)
    saved = first.state_dict()
    resumed = agg.get_rule(name, 2, seed=999)  # different seed: the state must win
    resumed.load_state_dict(saved)
    got = [resumed.aggregate(r).update for r in rounds[2:]]
    for g, w in zip(got, want[2:]):
        np.testing.assert_array_equal(g, w)
    assert resumed.rounds == 5


def test_state_from_another_pipeline_is_refused() -> None:
    sd = agg.get_rule("krum", 2).state_dict()
    with pytest.raises(agg.AggregationError, match="state is for 'krum'"):
        agg.get_rule("bulyan", 2).load_state_dict(sd)


def test_weights_are_honoured() -> None:
    x = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    w = np.array([2.0, 1.0, 1.0])
    np.testing.assert_allclose(agg.mean(x, weights=w).update, [0.25, 0.25])
    res = agg.get_rule("bucketing+mean", 0, bucket_size=3).aggregate(x, w)
    np.testing.assert_allclose(res.update, x.mean(axis=0))  # one bucket: plain mean of rows


def test_centered_clipping_quantile_option() -> None:
    x = np.random.default_rng(3).standard_normal((9, 20))
    with pytest.raises(agg.AggregationError, match="quantile"):
        agg.centered_clipping(x, quantile=0.0)
    lo = agg.get_rule("centered_clipping", 1, quantile=0.25).aggregate(x).update
    hi = agg.get_rule("centered_clipping", 1, quantile=1.0).aggregate(x).update
    # quantile 1 clips nobody in the first iteration: one iteration from 0 is the mean.
    one = agg.centered_clipping(x, quantile=1.0, iters=1).update
    np.testing.assert_allclose(one, x.mean(axis=0), rtol=1e-12)
    assert np.linalg.norm(lo) <= np.linalg.norm(hi) + 1e-12


# --------------------------------------------------------------------------- selection property

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402 - after the importorskip above
from hypothesis import strategies as st  # noqa: E402 - after the importorskip above


def _ref_select(dist: np.ndarray, f: int, m: int) -> tuple[set[int], float]:
    """Multi-Krum selection from reference distances, and its relative boundary gap."""
    s = np.asarray(ref_scores(dist, list(range(len(dist))), f))
    order = np.argsort(s, kind="stable")
    gap = np.inf if m == len(s) else (s[order[m]] - s[order[m - 1]]) / max(s[order[m]], 1e-300)
    return {int(i) for i in order[:m]}, float(gap)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.sampled_from([1e-3, 1e-5, 1e-6]),
       dups=st.integers(0, 4), m=st.integers(1, 8), dtype=st.sampled_from(["f4", "f8"]))
def test_krum_selection_equals_direct_float64_on_near_ties(seed: int, noise: float, dups: int,
                                                           m: int, dtype: str) -> None:
    """Near-identical rows, exact copies and far outliers: the selected set is the one
    the direct float64 distances give whenever that choice is not itself a tie."""
    rng = np.random.default_rng(seed)
    n, f, d = 11, 2, 257
    base = rng.standard_normal(d) * 10.0
    x = base + rng.standard_normal((n, d)) * noise
    x[n - f:] = base * -3.0  # identical far Byzantine copies
    for k in range(dups):  # exact copies of honest rows make exact score ties
        x[1 + k] = x[0]
    x = x.astype(dtype)
    want, gap = _ref_select(agg.direct_sq_distances(x), f, m)
    got = set(agg.multi_krum(x, f=f, m=m).selected)
    if gap > 1e-9:
        assert got == want
    else:  # a genuine tie: any tied choice has the same score multiset
        s = ref_scores(agg.direct_sq_distances(x), list(range(n)), f)
        assert sorted(s[i] for i in got) == pytest.approx(sorted(s[i] for i in want), rel=1e-9)
    if n >= 4 * f + 3 and dups == 0 and gap > 1e-9:
        _assert_bulyan_up_to_ties(x, f, agg.bulyan(x, f=f).update)


def _assert_bulyan_up_to_ties(x: np.ndarray, f: int, got: np.ndarray) -> None:
    """Per coordinate, ``got`` is the mean of *some* set of n-4f selected values closest to the
    median: values on float32's grid can be exactly equidistant from it, and the paper fixes no
    tie-break, so any closest set is right (the reference's stable argsort is one choice)."""
    n = len(x)
    theta, beta, dist = n - 2 * f, n - 4 * f, ref_dist(x)
    rest, picked = list(range(n)), []
    for _ in range(theta):
        best = rest[int(np.argmin(ref_scores(dist, rest, f)))]
        picked.append(best)
        rest.remove(best)
    sel = np.sort(x[picked].astype(np.float64), axis=0)
    med = np.median(sel, axis=0)
    for c in range(x.shape[1]):
        col, d = sel[:, c], np.abs(sel[:, c] - med[c])
        best = np.sort(d)[:beta]
        means = [col[i:i + beta].mean() for i in range(theta - beta + 1)
                 if np.allclose(np.sort(d[i:i + beta]), best, rtol=0, atol=0)]
        assert means and min(abs(m - got[c]) for m in means) <= 1e-9 * max(1.0, abs(got[c])), c
