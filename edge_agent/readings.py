"""What probes report: static capabilities (for the birth) and changing readings (for state)."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Capabilities", "Reading"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Static figures of a device; field names follow COST_MODEL.md and DeviceBirth."""

    flops: float
    memory_bytes: int  # memory free for partitions at start
    uplink_bps: float
    downlink_bps: float
    rtt_s: float
    power_active_w: float
    power_idle_w: float
    tx_j_per_byte: float = 0.0
    rx_j_per_byte: float = 0.0
    battery_capacity_wh: float | None = None
    cpu_count: int = 1
    accelerators: tuple[str, ...] = ()
    providers: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    simulated: bool = False
    model: str = ""  # board model string or profile name


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
