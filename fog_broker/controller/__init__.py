"""Deployment controller (pure core): desired placements vs reported partitions -> commands."""
from __future__ import annotations

from ._core import (
    Assignment, Command, Controller, ControllerConfig, DeployPartition, PartKey, Persist, Phase,
    ScheduleFn, UndeployPartition, WorkloadEntry, sub_profile,
)

__all__ = [
    "Assignment", "Command", "Controller", "ControllerConfig", "DeployPartition", "PartKey",
    "Persist", "Phase", "ScheduleFn", "UndeployPartition", "WorkloadEntry", "sub_profile",
]
