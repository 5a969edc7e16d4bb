"""Deployment controller (pure core): desired placements vs reported partitions -> commands.

``model`` (assignments, phases, switches, commands, config), ``switch`` (the version switch's
transition table), ``observe``, ``repair``, ``scaling`` and ``apply`` (the stages of a pass),
``_core`` (the ``Controller``: its book and the loop).
"""
from __future__ import annotations

from ._core import Controller
from .model import (
    BREAK_BEFORE_MAKE,
    MAKE_BEFORE_BREAK,
    ROLLING,
    SWITCH_REASON,
    Assignment,
    Command,
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
from .switch import TRANSITIONS, Step

__all__ = [
    "Assignment", "Command", "Controller", "ControllerConfig", "DeployPartition", "PartKey",
    "Persist", "Phase", "ScheduleFn", "UndeployPartition", "WorkloadEntry", "sub_profile",
    "Switch", "MAKE_BEFORE_BREAK", "ROLLING", "BREAK_BEFORE_MAKE", "SWITCH_REASON", "TRANSITIONS", "Step",
]
