"""Site metrics over device memory, exactly as COST_MODEL.md defines them."""
from __future__ import annotations

from collections.abc import Mapping

from .model import Fleet

__all__ = ["site_metrics"]


def site_metrics(fleet: Fleet, used: Mapping[str, float]) -> tuple[float, float]:
    """``(utilization, fragmentation)`` from the bytes each device hosts in the plan.

    utilization = sum(used) / sum(memory of alive devices);
    fragmentation = 1 - sum(used) / sum(memory of devices with any partition).
    """
    total_used = sum(v for v in used.values() if v > 0)
    alive_mem = sum(d.memory_bytes for d in fleet.devices if d.alive)
    busy_mem = sum(d.memory_bytes for d in fleet.devices if used.get(d.id, 0.0) > 0)
    util = total_used / alive_mem if alive_mem > 0 else 0.0
    frag = 1.0 - total_used / busy_mem if busy_mem > 0 else 0.0
    return util, max(0.0, frag)
