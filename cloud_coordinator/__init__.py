"""cloud_coordinator: the Flower coordinator of a Fogline deployment.

``RobustStrategy`` (a Flower Message-API strategy: Byzantine-robust rules,
bounded rounds, signed quorum-replicated checkpoints with resume, releases of
the trained model to the fog), its settings grouped in ``RoundConfig`` (sampling,
quorum, deadlines), ``ReplyConfig``, ``CheckpointConfig`` and ``Release`` (the export
hook) are the public API for Flower Apps. Pure cores live in ``cloud_coordinator.aggregation``
(rules, pre-aggregators, the stateful ``Aggregator``),
``cloud_coordinator.attacks`` and ``cloud_coordinator.rollout`` (staged
release rollouts across sites, driven by ``siteservice``: docs/sites.md). Importing this package imports neither Flower
nor numpy: the strategy loads on first use.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RobustStrategy", "RoundConfig", "ReplyConfig", "CheckpointConfig", "Release", "RunFailed"]


def __getattr__(name: str) -> Any:
    if name in ("RobustStrategy", "RunFailed", "RoundConfig", "ReplyConfig", "CheckpointConfig"):
        from . import strategy

        return getattr(strategy, name)
    if name == "Release":
        from .release import Release

        return Release
    raise AttributeError(name)
