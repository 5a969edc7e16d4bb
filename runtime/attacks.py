"""Byzantine attacks, as pure functions the simulator, the benchmarks and a Byzantine edge client
share (in ``runtime`` so the edge does not import the coordinator; ``cloud_coordinator.attacks``
re-exports them).

Model-poisoning attacks take the honest updates (n_honest, d) -- the attackers
are omniscient, the standard worst case -- and return f Byzantine rows (f, d).
Label flipping acts on data, so it is a data transform. Adaptive attacks get a
side-effect-free ``probe`` (updates -> aggregate) of the server's rule and
tune their strength against it each round. Randomness only via an injected
``np.random.Generator``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

__all__ = [
    "ATTACKS", "AttackOutcome", "sign_flip", "ipm", "alie", "alie_z", "gaussian", "flip_labels",
    "adaptive", "adaptive_alie", "adaptive_ipm", "ALIE_STRENGTHS", "IPM_STRENGTHS",
]

Probe = Callable[[np.ndarray], np.ndarray]


def _check(honest: np.ndarray, f: int) -> np.ndarray:
    h = np.asarray(honest, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] < 1:
        raise ValueError(f"honest updates must be a non-empty (n, d) array, got {h.shape}")
    if f < 0:
        raise ValueError(f"f must be non-negative, got {f}")
    return h


def sign_flip(honest: np.ndarray, f: int, *, scale: float = 4.0) -> np.ndarray:
    """Every attacker sends -scale times the honest mean (reversed gradient, amplified)."""
    h = _check(honest, f)
    return np.tile(-scale * h.mean(axis=0), (f, 1))


def ipm(honest: np.ndarray, f: int, *, eps: float = 0.1) -> np.ndarray:
    """Inner product manipulation (Xie, Koyejo, Gupta 2020): -eps times the honest mean."""
    h = _check(honest, f)
    return np.tile(-eps * h.mean(axis=0), (f, 1))


def alie_z(n: int, f: int) -> float:
    """ALIE's default z: enough 'supporters' s = floor(n/2 + 1) - f stay below it."""
    s = n // 2 + 1 - f
    p = (n - s) / n
    return float(NormalDist().inv_cdf(min(max(p, 1e-6), 1 - 1e-6)))


def alie(honest: np.ndarray, f: int, *, z: float | None = None, n: int | None = None) -> np.ndarray:
    """A little is enough (Baruch, Baruch, Goldberg 2019): mean - z * std per coordinate."""
    h = _check(honest, f)
    zz = alie_z(n if n is not None else h.shape[0] + f, f) if z is None else z
    return np.tile(h.mean(axis=0) - zz * h.std(axis=0), (f, 1))


def gaussian(honest: np.ndarray, f: int, *, rng: np.random.Generator,
             scale: float = 30.0) -> np.ndarray:
    """Noise rows N(0, (scale * honest RMS)^2), independent per attacker."""
    h = _check(honest, f)
    rms = float(np.sqrt(np.mean(h ** 2))) or 1.0
    return rng.normal(0.0, scale * rms, (f, h.shape[1]))


def flip_labels(y: np.ndarray, n_classes: int) -> np.ndarray:
    """Label flipping as a data transform: class c becomes n_classes - 1 - c."""
    return (n_classes - 1 - np.asarray(y)).astype(np.asarray(y).dtype)


@dataclass(frozen=True, slots=True)
class AttackOutcome:
    """The Byzantine rows an adaptive attacker sends, and the strength it chose."""

    byzantine: np.ndarray
    strength: float
    displacement: float


def adaptive(honest: np.ndarray, f: int, make: Callable[[float], np.ndarray],
             strengths: Sequence[float], probe: Probe,
             place: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> AttackOutcome:
    """Try each strength against the server's rule; keep the one that moves the
    aggregate furthest from the honest mean (the attacker knows the rule).

    ``place(honest, byzantine)`` stacks the rows in the server's order
    (default: honest first).
    """
    h = _check(honest, f)
    target = h.mean(axis=0)
    stack = place or (lambda a, b: np.vstack([a, b]))
    best: AttackOutcome | None = None
    for s in strengths:
        byz = make(float(s))
        moved = float(np.linalg.norm(probe(stack(h, byz)) - target))
        if best is None or moved > best.displacement:
            best = AttackOutcome(byz, float(s), moved)
    assert best is not None, "strengths must not be empty"
    return best


ALIE_STRENGTHS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
IPM_STRENGTHS: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0, 4.0, 10.0, 100.0)


Place = Callable[[np.ndarray, np.ndarray], np.ndarray]


def adaptive_alie(honest: np.ndarray, f: int, probe: Probe,
                  strengths: Sequence[float] = ALIE_STRENGTHS,
                  place: Place | None = None) -> AttackOutcome:
    """ALIE with z tuned each round against the rule."""
    return adaptive(honest, f, lambda z: alie(honest, f, z=z), strengths, probe, place)


def adaptive_ipm(honest: np.ndarray, f: int, probe: Probe,
                 strengths: Sequence[float] = IPM_STRENGTHS,
                 place: Place | None = None) -> AttackOutcome:
    """IPM with eps tuned each round against the rule."""
    return adaptive(honest, f, lambda e: ipm(honest, f, eps=e), strengths, probe, place)


# Names the simulator and the robustness benchmark understand. "label_flip" acts on
# data; the adaptive ones need a probe; the rest map honest updates to Byzantine rows.
ATTACKS: tuple[str, ...] = (
    "none", "sign_flip", "ipm", "alie", "label_flip", "gaussian", "adaptive_alie", "adaptive_ipm",
)
