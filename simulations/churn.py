"""Churn and faults as pure functions of (state, dt, rng): batteries, failures, partitions.

The discrete-event engine and the real-process fleets both draw their
faults from here, so a scenario means the same thing in both. Time and
randomness are parameters; nothing reads a clock.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

__all__ = [
    "SimBattery", "drain", "FailureModel", "next_failure", "Fault", "fault_schedule",
]


@dataclass(frozen=True, slots=True)
class SimBattery:
    """A battery's state: ``level`` in [0, 1]; ``charge_w`` > 0 while on a charger/solar."""

    capacity_wh: float
    level: float
    charge_w: float = 0.0

    @property
    def charging(self) -> bool:
        return self.charge_w > 0.0

    @property
    def dead(self) -> bool:
        return self.level <= 0.0


def drain(battery: SimBattery, power_w: float, dt_s: float) -> SimBattery:
    """Battery after ``dt_s`` seconds drawing ``power_w`` (net of any charging), clamped to [0, 1]."""
    if battery.capacity_wh <= 0:
        return battery
    net_wh = (battery.charge_w - power_w) * dt_s / 3600.0
    level = min(1.0, max(0.0, battery.level + net_wh / battery.capacity_wh))
    return replace(battery, level=level)


def time_to_empty(battery: SimBattery, power_w: float) -> float:
    """Seconds until the battery is empty at a constant draw (inf when not draining)."""
    net_w = power_w - battery.charge_w
    if net_w <= 0 or battery.capacity_wh <= 0:
        return math.inf
    return battery.level * battery.capacity_wh * 3600.0 / net_w


@dataclass(frozen=True, slots=True)
class FailureModel:
    """Crash-recover churn: exponential time to failure (MTBF) and to repair (MTTR)."""

    mtbf_s: float
    mttr_s: float = 60.0


def next_failure(model: FailureModel, now: float, rng: random.Random) -> tuple[float, float]:
    """(time of the next crash, time the device comes back) after ``now``."""
    down = now + rng.expovariate(1.0 / model.mtbf_s) if model.mtbf_s > 0 else math.inf
    return down, down + rng.expovariate(1.0 / model.mttr_s) if model.mttr_s > 0 else down


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: ``kind`` is crash | recover | partition | heal | battery."""

    at_s: float
    kind: str
    target: str  # device id, or site name for partitions


def fault_schedule(device_ids: list[str], model: FailureModel, horizon_s: float,
                   rng: random.Random) -> list[Fault]:
    """Crash/recover events for every device up to ``horizon_s``, sorted by time."""
    faults: list[Fault] = []
    for dev in device_ids:
        t = 0.0
        while True:
            down, up = next_failure(model, t, rng)
            if down >= horizon_s:
                break
            faults.append(Fault(down, "crash", dev))
            if up < horizon_s:
                faults.append(Fault(up, "recover", dev))
            t = up
    faults.sort(key=lambda f: (f.at_s, f.target))
    return faults
