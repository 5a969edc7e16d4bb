"""The scheduler's answer and its JSON: per-workload results, replica chains, site metrics.

Frozen, slotted dataclasses; ``from_dict`` turns a malformed plan into ``SpecError`` naming the
field. The JSON shapes are those of ``COST_MODEL.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .spec import SpecError, _int, _list, _num, _obj, _req, _str

__all__ = ["PartitionPlacement", "ReplicaPlacement", "WorkloadPlacement", "WorkloadResult",
           "PlanMetrics", "Plan"]


@dataclass(frozen=True, slots=True)
class PartitionPlacement:
    """Segments ``first..last`` (inclusive) run on ``device``."""

    first: int
    last: int
    device: str

    def to_dict(self) -> dict[str, Any]:
        return {"segments": [self.first, self.last], "device": self.device}

    @classmethod
    def from_dict(cls, d: Any, where: str = "partition") -> PartitionPlacement:
        d = _obj(d, where)
        seg = _list(_req(d, "segments", where), f"{where}.segments")
        if len(seg) != 2:
            raise SpecError(f"{where}.segments: expected [first, last]")
        return cls(_int(seg[0], f"{where}.segments[0]", minimum=0),
                   _int(seg[1], f"{where}.segments[1]", minimum=0),
                   _str(_req(d, "device", where), f"{where}.device"))


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """One replica chain with its predicted cost under the reference model."""

    partitions: tuple[PartitionPlacement, ...]
    latency_s: float
    energy_j: float
    #: The slowest pipeline stage (s), set for throughput workloads (0: not computed).
    bottleneck_s: float = 0.0

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(p.device for p in self.partitions)

    def to_dict(self) -> dict[str, Any]:
        out = {"partitions": [p.to_dict() for p in self.partitions],
               "latency_s": self.latency_s, "energy_j": self.energy_j}
        if self.bottleneck_s > 0:
            out["bottleneck_s"] = self.bottleneck_s
            out["frames_per_s"] = 1.0 / self.bottleneck_s
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "replica") -> ReplicaPlacement:
        d = _obj(d, where)
        parts = _list(_req(d, "partitions", where), f"{where}.partitions")
        return cls(tuple(PartitionPlacement.from_dict(p, f"{where}.partitions[{i}]")
                         for i, p in enumerate(parts)),
                   _num(d.get("latency_s", 0.0), f"{where}.latency_s"),
                   _num(d.get("energy_j", 0.0), f"{where}.energy_j"),
                   _num(d.get("bottleneck_s", 0.0), f"{where}.bottleneck_s"))


@dataclass(frozen=True, slots=True)
class WorkloadPlacement:
    """What runs for one workload: its replica chains, the primary first."""

    replicas: tuple[ReplicaPlacement, ...]

    @classmethod
    def from_dict(cls, d: Any, where: str = "placement") -> WorkloadPlacement:
        d = _obj(d, where)
        reps = _list(_req(d, "replicas", where), f"{where}.replicas")
        return cls(tuple(ReplicaPlacement.from_dict(r, f"{where}.replicas[{i}]")
                         for i, r in enumerate(reps)))


@dataclass(frozen=True, slots=True)
class WorkloadResult:
    """One workload's outcome: placed (with replicas) or pending (with a reason per failed gate).

    ``reasons`` are sentences for people; ``detail`` holds the same facts as ids and numbers
    (node-reason histogram, bytes asked and free) for programs.
    """

    name: str
    status: str  # "placed" | "pending"
    replicas: tuple[ReplicaPlacement, ...] = ()
    reasons: tuple[tuple[str, str], ...] = ()
    detail: tuple[tuple[str, Any], ...] = ()
    kept: bool = False

    @property
    def placed(self) -> bool:
        return self.status == "placed"

    @property
    def placement(self) -> WorkloadPlacement:
        return WorkloadPlacement(self.replicas)

    @property
    def reason_map(self) -> dict[str, str]:
        return dict(self.reasons)

    @property
    def detail_map(self) -> dict[str, Any]:
        return dict(self.detail)

    def to_dict(self) -> dict[str, Any]:
        if self.placed:
            return {"name": self.name, "status": "placed",
                    "replicas": [r.to_dict() for r in self.replicas]}
        return {"name": self.name, "status": "pending", "reasons": dict(self.reasons)}


@dataclass(frozen=True, slots=True)
class PlanMetrics:
    """Site metrics of COST_MODEL.md; ``solve_s`` is filled in by the shell (the core reads no clock)."""

    utilization: float
    fragmentation: float
    solve_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"utilization": self.utilization, "fragmentation": self.fragmentation,
                "solve_s": self.solve_s}


@dataclass(frozen=True, slots=True)
class Plan:
    """The scheduler's answer: one result per workload (input order), the evicted names, metrics."""

    workloads: tuple[WorkloadResult, ...]
    evicted: tuple[str, ...]
    metrics: PlanMetrics

    def result(self, name: str) -> WorkloadResult:
        for r in self.workloads:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def placements(self) -> dict[str, WorkloadPlacement]:
        """Feed back as ``current`` on the next reconcile."""
        return {r.name: r.placement for r in self.workloads if r.placed}

    def with_solve_s(self, seconds: float) -> Plan:
        m = self.metrics
        return Plan(self.workloads, self.evicted,
                    PlanMetrics(m.utilization, m.fragmentation, seconds))

    def to_dict(self) -> dict[str, Any]:
        return {"workloads": [r.to_dict() for r in self.workloads],
                "evicted": list(self.evicted),
                "metrics": self.metrics.to_dict()}
