"""Deployment controller (pure core): desired placements vs reported partitions -> commands."""
from __future__ import annotations

from ._core import (
    BREAK_BEFORE_MAKE,
    MAKE_BEFORE_BREAK,
    ROLLING,
    Assignment,
    Command,
    Controller,
    ControllerConfig,
    DeployPartition,
    PartKey,
    Persist,
    Phase,
    ScheduleFn,
    Switch,
    UndeployPartition,
    WorkloadEntry,
    sub_profile,
)

__all__ = [
    "Assignment", "Command", "Controller", "ControllerConfig", "DeployPartition", "PartKey",
    "Persist", "Phase", "ScheduleFn", "UndeployPartition", "WorkloadEntry", "sub_profile",
    "Switch", "MAKE_BEFORE_BREAK", "ROLLING", "BREAK_BEFORE_MAKE",
]
