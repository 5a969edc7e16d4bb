"""Byzantine attacks: the pure functions live in ``runtime.attacks`` (a Byzantine edge client uses
them too, and the edge must not import the coordinator); re-exported here for the simulator and
the benchmarks."""
from __future__ import annotations

from runtime.attacks import (
    ALIE_STRENGTHS,
    ATTACKS,
    IPM_STRENGTHS,
    AttackOutcome,
    adaptive,
    adaptive_alie,
    adaptive_ipm,
    alie,
    alie_z,
    flip_labels,
    gaussian,
    ipm,
    sign_flip,
)

__all__ = [
    "ATTACKS", "AttackOutcome", "sign_flip", "ipm", "alie", "alie_z", "gaussian", "flip_labels",
    "adaptive", "adaptive_alie", "adaptive_ipm", "ALIE_STRENGTHS", "IPM_STRENGTHS",
]
