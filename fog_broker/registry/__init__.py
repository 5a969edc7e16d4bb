"""Fleet registry (pure core): device records from birth / state / death adverts, liveness by table."""
from __future__ import annotations

from ._core import (
    DeviceJoined, DeviceLost, DeviceRecord, DeviceStatus, RegistryConfig, Registry,
    RequestRebirth, TRANSITIONS, training_fitness,
)

__all__ = [
    "DeviceJoined", "DeviceLost", "DeviceRecord", "DeviceStatus", "RegistryConfig", "Registry",
    "RequestRebirth", "TRANSITIONS", "training_fitness",
]
