"""Pure placement core of the fog broker: fleet snapshot + workloads + what runs -> plan.

No I/O, no clock, no randomness: the broker service, the ``fogline place`` command,
tests and simulations all call ``schedule`` on plain data.
"""
from __future__ import annotations

from .chain import ChainSolution, DeviceTable, solve_chain
from .cost import ChainCost, chain_cost
from .metrics import site_metrics
from .model import (
    Battery,
    ChainProfile,
    Device,
    Fleet,
    Quota,
    Segment,
    Taint,
    Toleration,
    Workload,
    parse_workloads,
)
from .plan import (
    PartitionPlacement,
    Plan,
    PlanMetrics,
    ReplicaPlacement,
    WorkloadPlacement,
    WorkloadResult,
)
from .plugins import (
    GATE_ALIVE,
    GATE_ANTI_AFFINITY,
    GATE_ENERGY,
    GATE_FIT,
    GATE_LATENCY,
    GATE_PROVIDERS,
    GATE_QUOTA,
    GATE_SELECTOR,
    GATE_TAINT,
    GATE_THROTTLED,
    GATE_VERIFIED,
    Code,
    Status,
)
from .scheduler import SchedulerConfig, schedule
from .spec import SpecError
from .validate import validate_plan

__all__ = [
    "schedule", "SchedulerConfig", "Fleet", "Device", "Battery", "Taint", "Toleration",
    "Workload", "ChainProfile", "Segment", "Quota", "Plan", "PlanMetrics", "WorkloadResult",
    "WorkloadPlacement", "ReplicaPlacement", "PartitionPlacement", "SpecError",
    "parse_workloads", "chain_cost", "ChainCost", "solve_chain", "ChainSolution", "DeviceTable",
    "site_metrics", "validate_plan", "Code", "Status",
    "GATE_ALIVE", "GATE_SELECTOR", "GATE_TAINT", "GATE_PROVIDERS", "GATE_ENERGY", "GATE_THROTTLED",
    "GATE_VERIFIED", "GATE_ANTI_AFFINITY", "GATE_FIT", "GATE_QUOTA", "GATE_LATENCY",
]
