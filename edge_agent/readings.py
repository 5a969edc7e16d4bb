"""What probes report: static capabilities (for the birth) and changing readings (for state)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from runtime._schema import schema_of
from runtime.devices import DeviceResources, range_problem
from runtime.messages import STATE_RANGES

__all__ = ["Capabilities", "Reading"]


@dataclass(frozen=True, slots=True)
class Capabilities(DeviceResources):
    """Static figures of a device as its probe reads them: the one device record
    (``runtime.devices.DeviceResources``, checked against its ranges at construction, so a probe
    that reads nonsense fails here naming the figure) plus what only the agent knows."""

    simulated: bool = False
    model: str = ""  # board model string or profile name


schema_of(Capabilities)


@dataclass(frozen=True, slots=True)
class Reading:
    """One sample of the changing figures; None means "this device has no such sensor"."""

    free_memory_bytes: int
    cpu_load: float = 0.0
    cpu_freq_mhz: float | None = None
    temperature_c: float | None = None
    throttled: bool = False
    battery_level: float | None = None  # None: mains powered
    charging: bool = False
    power_w: float | None = None
    metered: bool = False

    def __post_init__(self) -> None:
        # A sensor reading outside what a state advert may carry (runtime.messages.STATE_RANGES,
        # e.g. a thermal zone answering -300 C) is "no such reading", not a state the fog refuses
        # or an agent that stops advertising.
        lv = self.battery_level
        if lv is not None and range_problem(STATE_RANGES, "battery_level", lv) is not None:
            object.__setattr__(self, "battery_level", min(max(lv, 0.0), 1.0) if math.isfinite(lv) else None)
        for name in ("temperature_c", "power_w"):
            if range_problem(STATE_RANGES, name, getattr(self, name)) is not None:
                object.__setattr__(self, name, None)
        if range_problem(STATE_RANGES, "cpu_load", self.cpu_load) is not None:
            object.__setattr__(self, "cpu_load", 0.0)
        hi = int(STATE_RANGES["free_memory_bytes"].hi)
        object.__setattr__(self, "free_memory_bytes", min(max(int(self.free_memory_bytes), 0), hi))
