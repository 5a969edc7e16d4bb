"""A simulated device: a DeviceProfile in place of the probes, same agent code path otherwise.

Battery drains with the modelled power: idle power all the time plus the
active-minus-idle difference for the seconds the executor computed.
``speedup`` scales the drain so a demo sees batteries move in minutes.
"""
from __future__ import annotations

import random
from collections.abc import Callable

from .profiles import DeviceProfile
from .readings import Capabilities, Reading

__all__ = ["SimulatedDevice"]


class SimulatedDevice:
    """Probe interface (``capabilities()``, ``read(now, busy_s)``) backed by a profile."""

    def __init__(self, profile: DeviceProfile, *, seed: int = 0, speedup: float = 1.0,
                 battery_level: float | None = None, reserved: Callable[[], int] | None = None) -> None:
        self.profile = profile
        self.speedup = speedup
        self._rng = random.Random(seed)
        self._level = profile.battery_level if battery_level is None else battery_level
        self._last_now: float | None = None
        self._last_busy = 0.0
        self.reserved = reserved  # memory held by deployed partitions (set by the agent)
        self.model = profile.name

    def capabilities(self) -> Capabilities:
        p = self.profile
        return Capabilities(**{**p.resource_kwargs(), "labels": dict(p.labels)}, simulated=True,
                            model=p.name)

    def read(self, now: float, busy_s: float = 0.0) -> Reading:
        p = self.profile
        dt = 0.0 if self._last_now is None else max(0.0, now - self._last_now)
        busy = min(dt, max(0.0, busy_s - self._last_busy)) if self._last_now is not None else 0.0
        self._last_now, self._last_busy = now, busy_s
        load = busy / dt if dt > 0 else 0.0
        power = p.power_idle_w + (p.power_active_w - p.power_idle_w) * load
        if p.battery_capacity_wh is not None:
            joules = (p.power_idle_w * dt + (p.power_active_w - p.power_idle_w) * busy) * self.speedup
            self._level = max(0.0, self._level - joules / (p.battery_capacity_wh * 3600.0))
        used = self.reserved() if self.reserved is not None else 0
        return Reading(
            free_memory_bytes=max(0, p.memory_bytes - used), cpu_load=round(load, 3),
            temperature_c=round(40.0 + 30.0 * load + self._rng.uniform(-0.5, 0.5), 1), throttled=False,
            battery_level=round(self._level, 4) if p.battery_capacity_wh is not None else None,
            charging=False, power_w=round(power, 3))
