"""Fleet registry (pure core): device records from birth / state / death adverts, liveness by table."""
from __future__ import annotations

from ._core import (
    CLAIM_ABOVE_MEASURED,
    CLAIM_REFUTED,
    CLAIM_TOLERANCE,
    TRANSITIONS,
    DeviceJoined,
    DeviceLost,
    DeviceRecord,
    DeviceStatus,
    Registry,
    RegistryConfig,
    RequestRebirth,
    ThrottleChanged,
    capacity_flags,
    measured_power,
    training_fitness,
)

__all__ = [
    "DeviceJoined", "DeviceLost", "DeviceRecord", "DeviceStatus", "RegistryConfig", "Registry",
    "RequestRebirth", "TRANSITIONS", "training_fitness", "CLAIM_TOLERANCE", "CLAIM_ABOVE_MEASURED", "CLAIM_REFUTED",
    "capacity_flags", "ThrottleChanged", "measured_power",
]
