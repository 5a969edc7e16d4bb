"""Device profiles, re-exported: the table lives in ``edge_agent.profiles`` (devices must not
import the simulator; the simulator imports the devices' table)."""
from __future__ import annotations

from edge_agent.profiles import PROFILES, DeviceProfile, get_profile

__all__ = ["DeviceProfile", "PROFILES", "get_profile"]
