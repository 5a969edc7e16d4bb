"""Young/Daly checkpoint interval and the 'every k rounds' decision."""
from __future__ import annotations

import math

import pytest

from cloud_coordinator.policy import (
    CheckpointPolicy,
    daly_interval,
    estimate_mtbf,
    rounds_between_checkpoints,
    should_checkpoint,
    young_interval,
)
from runtime.errors import LocalViolation


@pytest.mark.parametrize("c, m, want", [(1.0, 50.0, 10.0), (2.0, 3600.0, 120.0), (0.5, 1.0, 1.0)])
def test_young_is_sqrt_2cm(c: float, m: float, want: float) -> None:
    assert young_interval(c, m) == pytest.approx(want)


def test_daly_close_to_young_when_c_small_and_capped_at_mtbf() -> None:
    c, m = 1.0, 1e6
    assert daly_interval(c, m) == pytest.approx(young_interval(c, m) - c, rel=1e-2)
    assert daly_interval(5.0, 2.0) == 2.0  # C >= 2M: checkpoint every MTBF
    c, m = 10.0, 100.0  # the formula, written out
    want = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    assert daly_interval(c, m) == pytest.approx(want)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_interval_rejects_bad_inputs(bad: float) -> None:
    with pytest.raises(LocalViolation):
        young_interval(bad, 10.0)
    with pytest.raises(LocalViolation):
        daly_interval(1.0, bad)


def test_mtbf_estimate_uses_prior() -> None:
    assert estimate_mtbf(0, 0.0, 3600.0) == 3600.0
    assert estimate_mtbf(3, 900.0, 3600.0) == pytest.approx(4500.0 / 4)


@pytest.mark.parametrize("mode, round_s, cost_s, failures, observed, want", [
    ("every-round", 7.0, 0.01, 0, 0.0, 1),
    ("young", None, 0.01, 0, 0.0, 1),            # not measured yet
    ("young", 7.0, 0.02, 0, 0.0, 1),              # sqrt(2*.02*3600)=12 s -> 1 round
    ("young", 1.0, 0.5, 0, 0.0, 50),              # sqrt(3600)=60 s -> capped at 50
    ("young", 2.0, 0.5, 0, 0.0, 30),              # 60 s / 2 s
    ("daly", 2.0, 0.5, 0, 0.0, 29),               # 59.7 s / 2 s
    ("young", 2.0, 0.5, 99, 0.0, 3),              # MTBF 36 s -> 6 s / 2 s
])
def test_rounds_between(mode: str, round_s: float | None, cost_s: float, failures: int,
                        observed: float, want: int) -> None:
    pol = CheckpointPolicy(mode=mode)
    assert rounds_between_checkpoints(pol, round_s, cost_s, failures, observed) == want


@pytest.mark.parametrize("rnd, last, total, every, want", [
    (1, 0, 5, 1, True), (2, 0, 5, 3, False), (3, 0, 5, 3, True), (5, 3, 5, 10, True), (4, 3, 5, 10, False),
])
def test_should_checkpoint(rnd: int, last: int, total: int, every: int, want: bool) -> None:
    assert should_checkpoint(rnd, last, total, every) is want


def test_policy_validates() -> None:
    with pytest.raises(LocalViolation):
        CheckpointPolicy(mode="sometimes")
    with pytest.raises(LocalViolation):
        CheckpointPolicy(keep=0)
