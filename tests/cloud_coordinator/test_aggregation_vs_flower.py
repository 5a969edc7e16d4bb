"""Cross-check against Flower's own rules where their definitions coincide."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_coordinator import aggregation as agg

flwr = pytest.importorskip("flwr")


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    # Well-conditioned float64 rows, so Flower's Gram shortcut is accurate here.
    return np.random.default_rng(0).standard_normal((15, 200))


def test_median_and_trimmed_mean_equal_flowers(rows: np.ndarray) -> None:
    from flwr.server.strategy.aggregate import aggregate_median
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean

    layers = [([r], 1) for r in rows]
    np.testing.assert_allclose(agg.coordinate_median(rows).update, aggregate_median(layers)[0])
    np.testing.assert_allclose(agg.trimmed_mean(rows, f=3).update, trim_mean(rows, 3 / 15))


@pytest.mark.parametrize("m", [1, 5, 12])
def test_krum_selection_equals_flowers_on_well_conditioned_rows(rows: np.ndarray, m: int) -> None:
    from flwr.app import ArrayRecord, RecordDict
    from flwr.serverapp.strategy.multikrum import select_multikrum

    contents = [RecordDict({"arrays": ArrayRecord([r])}) for r in rows]
    picked = select_multikrum(contents, 3, m)
    theirs = sorted(contents.index(c) for c in picked)
    assert list(agg.multi_krum(rows, f=3, m=m).selected) == theirs


def test_robustness_bench_smoke() -> None:
    pytest.importorskip("sklearn")
    from benchmarks import robustness_bench as rb

    data = rb.load_digits_split(0)
    s = rb.Setup(rounds=3)
    for attack in ("none", "label_flip", "adaptive_ipm"):
        acc = rb.run_one("centered_clipping", attack, 0.5, 0, s, data)
        assert 0.0 <= acc <= 1.0


def test_aggregation_bench_reports_both_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fogline bench aggregation`` times from replies and in memory, default workers and one."""
    from benchmarks import aggregation_bench as ab

    monkeypatch.setenv("FOGLINE_AGG_THREADS", "2")
    out = ab.run(True, 1, {"krum", "multi_krum"}, 1)
    assert out["fogline_workers"] == 2
    assert [r["rule"] for r in out["rules"]] == ["krum", "multi_krum"]
    assert [r["rule"] for r in out["from_replies"]] == ["krum", "multi_krum"]
    for row in out["rules"] + out["from_replies"]:
        assert row["speedup"] > 0 and row["speedup_1w"] > 0
        assert row["fogline_s"] > 0 and row["fogline_1w_s"] > 0 and row["flower_s"] > 0
