"""Attacks: shapes, definitions, and the adaptive attacker's choice."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_coordinator import aggregation as agg
from cloud_coordinator import attacks as atk


@pytest.fixture
def honest() -> np.ndarray:
    return np.random.default_rng(0).normal(1.0, 0.5, (20, 30))


@pytest.mark.parametrize(
    "make,expect",
    [
        (lambda h: atk.sign_flip(h, 5), lambda h: -4.0 * h.mean(axis=0)),
        (lambda h: atk.sign_flip(h, 5, scale=1.0), lambda h: -h.mean(axis=0)),
        (lambda h: atk.ipm(h, 5), lambda h: -0.1 * h.mean(axis=0)),
        (lambda h: atk.alie(h, 5, z=1.5), lambda h: h.mean(axis=0) - 1.5 * h.std(axis=0)),
    ],
)
def test_attack_definitions(honest: np.ndarray, make, expect) -> None:  # type: ignore
    bad = make(honest)
    assert bad.shape == (5, 30)
    for row in bad:
        np.testing.assert_allclose(row, expect(honest))


def test_alie_default_z_follows_the_paper() -> None:
    # n=25, f=5: s = 13 - 5 = 8 supporters, z = Phi^-1((25 - 8) / 25) = Phi^-1(0.68)
    assert atk.alie_z(25, 5) == pytest.approx(0.4677, abs=1e-4)
    h = np.random.default_rng(1).standard_normal((20, 4))
    np.testing.assert_allclose(atk.alie(h, 5, n=25)[0], h.mean(0) - atk.alie_z(25, 5) * h.std(0))


def test_gaussian_uses_the_injected_rng(honest: np.ndarray) -> None:
    a = atk.gaussian(honest, 3, rng=np.random.default_rng(5))
    b = atk.gaussian(honest, 3, rng=np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (3, 30) and np.std(a) > 10 * np.std(honest)


def test_flip_labels() -> None:
    np.testing.assert_array_equal(atk.flip_labels(np.array([0, 3, 9]), 10), [9, 6, 0])


@pytest.mark.parametrize("rule", ["mean", "median", "krum", "nnm+centered_clipping"])
def test_adaptive_attacker_keeps_the_most_damaging_strength(honest: np.ndarray, rule: str) -> None:
    probe = lambda u: agg.get_rule(rule, 5).aggregate(u).update  # noqa: E731  (no side effects)
    out = atk.adaptive_alie(honest, 5, probe)
    moved = {z: np.linalg.norm(probe(np.vstack([honest, atk.alie(honest, 5, z=z)]))
                               - honest.mean(0)) for z in atk.ALIE_STRENGTHS}
    assert out.strength == max(moved, key=lambda z: moved[z])
    assert out.displacement == pytest.approx(max(moved.values()))
    ipm = atk.adaptive_ipm(honest, 5, probe)
    assert ipm.strength in atk.IPM_STRENGTHS and ipm.byzantine.shape == (5, 30)


def test_adaptive_attack_beats_fixed_one_against_fedavg(honest: np.ndarray) -> None:
    probe = lambda u: agg.mean(u).update  # noqa: E731
    fixed = np.linalg.norm(probe(np.vstack([honest, atk.ipm(honest, 5)])) - honest.mean(0))
    adaptive = atk.adaptive_ipm(honest, 5, probe).displacement
    assert adaptive > 10 * fixed


def test_attack_names() -> None:
    assert set(atk.ATTACKS) >= {"sign_flip", "ipm", "alie", "label_flip", "gaussian",
                                "adaptive_alie", "adaptive_ipm"}
    with pytest.raises(ValueError):
        atk.sign_flip(np.zeros(3), 1)
