"""Scheduler plugins in the spirit of the Kubernetes scheduling framework.

Each plugin is one small class with a ``name`` and one method returning a ``Status``.
Per-node reasons are fixed phrases (no ids, no numbers) so that ``explain`` can count
them into a histogram; numbers travel in structured detail fields instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Protocol

import numpy as np

from .model import NO_SCHEDULE_EFFECTS, Device, Quota, Workload

__all__ = [
    "Code", "Status", "Filter", "NodeView", "Alive", "NodeSelector", "TaintToleration",
    "EnergyFloor", "MemoryFit", "PowerDomainSpread", "QuotaCheck", "ObjectiveScore", "GangPermit",
    "DEFAULT_FILTERS", "NOT_ALIVE", "SELECTOR_MISMATCH", "UNTOLERATED_TAINT", "BATTERY_LOW",
    "INSUFFICIENT_MEMORY", "DOMAIN_TAKEN", "NO_PROVIDER", "ProviderFit", "first_failure",
    "UNVERIFIED", "VerifiedLead", "THROTTLED", "NotThrottled",
]

NOT_ALIVE = "device not alive"
SELECTOR_MISMATCH = "selector mismatch"
UNTOLERATED_TAINT = "untolerated taint"
BATTERY_LOW = "battery below floor"
INSUFFICIENT_MEMORY = "insufficient memory"
DOMAIN_TAKEN = "power domain taken by another replica"
NO_PROVIDER = "no required execution provider"
UNVERIFIED = "capacity claim unverified"
THROTTLED = "device throttled"


class Code(Enum):
    """What the scheduler does next with a verdict."""

    OK = auto()           # go on
    UNFIT = auto()        # does not fit now; evicting lower-priority work might help
    UNFIT_FINAL = auto()  # does not fit and evicting others will not help
    WAIT = auto()         # gang not complete yet: keep reservations, do not bind
    ERROR = auto()        # a plugin bug, never an expected outcome


@dataclass(frozen=True, slots=True)
class Status:
    code: Code = Code.OK
    reasons: tuple[str, ...] = ()
    plugin: str = ""

    @property
    def ok(self) -> bool:
        return self.code is Code.OK


OK = Status()


@dataclass(frozen=True, slots=True)
class NodeView:
    """What a filter may look at: the device, and its memory still free in this plan."""

    device: Device
    free_bytes: float


class Filter(Protocol):
    name: str

    def filter(self, workload: Workload, node: NodeView) -> Status: ...


class Alive:
    name = "Alive"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        if node.device.alive:
            return OK
        return Status(Code.UNFIT_FINAL, (NOT_ALIVE,), self.name)


class NodeSelector:
    name = "NodeSelector"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        labels = node.device.labels
        if all(item in labels for item in workload.selectors):
            return OK
        return Status(Code.UNFIT_FINAL, (SELECTOR_MISMATCH,), self.name)


class TaintToleration:
    name = "TaintToleration"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        for t in node.device.taints:
            if t.effect in NO_SCHEDULE_EFFECTS and not any(
                    tol.tolerates(t) for tol in workload.tolerations):
                return Status(Code.UNFIT_FINAL, (UNTOLERATED_TAINT,), self.name)
        return OK


class ProviderFit:
    """Accelerator selector: a workload naming providers runs only where one is offered.

    A device that reported no providers is taken to run the CPU provider only.
    """

    name = "ProviderFit"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        if not workload.providers:
            return OK
        offered = node.device.providers or ("CPUExecutionProvider",)
        if any(p in offered for p in workload.providers):
            return OK
        return Status(Code.UNFIT_FINAL, (NO_PROVIDER,), self.name)


@dataclass(frozen=True, slots=True)
class EnergyFloor:
    """A battery device below ``floor`` (charge fraction) and not charging takes no new work."""

    floor: float = 0.2
    name: str = "EnergyFloor"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        b = node.device.battery
        if b is None or b.charging or b.level >= self.floor:
            return OK
        return Status(Code.UNFIT_FINAL, (BATTERY_LOW,), self.name)


@dataclass(frozen=True, slots=True)
class MemoryFit:
    """A device that cannot hold even the smallest segment can host no partition at all."""

    min_bytes: float
    name: str = "MemoryFit"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        if node.free_bytes >= self.min_bytes:
            return OK
        return Status(Code.UNFIT, (INSUFFICIENT_MEMORY,), self.name)


@dataclass(frozen=True, slots=True)
class PowerDomainSpread:
    """Anti-affinity: a further replica avoids every power domain an earlier replica uses."""

    taken: frozenset[str] = field(default_factory=frozenset)
    name: str = "PowerDomainSpread"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        if node.device.power_domain not in self.taken:
            return OK
        return Status(Code.UNFIT_FINAL, (DOMAIN_TAKEN,), self.name)


@dataclass(frozen=True, slots=True)
class VerifiedLead:
    """A device whose capacity claim is flagged holds no first (or only) replica of anything.

    Its claim decides nothing a workload cannot survive losing: it may serve replica 1 and
    later, never the one every request goes to first. ``mask`` is the same verdict for the
    scheduler's vectorised path (one boolean per device of a snapshot).
    """

    replica: int = 0
    name: str = "VerifiedLead"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        if self.replica > 0 or node.device.verified:
            return OK
        return Status(Code.UNFIT_FINAL, (UNVERIFIED,), self.name)

    def mask(self, devices: Sequence[Device]) -> np.ndarray:
        if self.replica > 0:
            return np.ones(len(devices), dtype=bool)
        return np.fromiter((d.verified for d in devices), dtype=bool, count=len(devices))


class NotThrottled:
    """A device reporting thermal throttling takes no partition; what it runs is re-placed.

    Its segment times no longer hold, so it fails the plan; the workload stays pending with this
    reason if no other device fits. Usable again once it reports unthrottled. ``mask`` is the
    same verdict for the scheduler's vectorised path.
    """

    name = "NotThrottled"

    def filter(self, workload: Workload, node: NodeView) -> Status:
        if not node.device.throttled:
            return OK
        return Status(Code.UNFIT_FINAL, (THROTTLED,), self.name)

    def mask(self, devices: Sequence[Device]) -> np.ndarray:
        return np.fromiter((not d.throttled for d in devices), dtype=bool, count=len(devices))


#: Filters whose verdict depends only on the workload spec and the device (cacheable).
DEFAULT_FILTERS: tuple[type, ...] = (Alive, NodeSelector, TaintToleration, ProviderFit)


@dataclass(frozen=True, slots=True)
class QuotaCheck:
    """Tenant memory quota: a pre-filter over the whole gang, not per node."""

    name: str = "Quota"

    def check(self, asked: float, used: float, quota: Quota | None) -> Status:
        if quota is None or used + asked <= quota.memory_bytes:
            return OK
        return Status(Code.UNFIT_FINAL, ("quota exhausted",), self.name)


@dataclass(frozen=True, slots=True)
class ObjectiveScore:
    """Score of a chain: its objective under the reference model (lower is better)."""

    name: str = "Objective"

    def score(self, workload: Workload, latency_s: float, energy_j: float) -> float:
        return energy_j if workload.objective == "energy" else latency_s


class GangPermit:
    """All partitions of all replicas, or nothing: reservations on a scratch copy, released on reject.

    ``unreserve`` is idempotent, so a rejected gang never leaves memory behind.
    """

    name = "Gang"
    __slots__ = ("_free", "required", "reserved")

    def __init__(self, free: Any, required: int) -> None:
        self.required = required
        self.reserved: list[tuple[int, float]] = []
        self._free = free

    def reserve(self, device: int, nbytes: float) -> None:
        assert self._free is not None
        self._free[device] -= nbytes
        self.reserved.append((device, nbytes))

    def permit(self, placed_replicas: int) -> Status:
        if placed_replicas >= self.required:
            return OK
        return Status(Code.WAIT, ("gang incomplete",), self.name)

    def unreserve(self) -> None:
        if self._free is not None:
            for dev, nbytes in self.reserved:
                self._free[dev] += nbytes
        self.reserved = []


def first_failure(filters: Sequence[Filter], workload: Workload, node: NodeView) -> Status:
    """The first failing filter's status (Kubernetes stops at the first one per node)."""
    for f in filters:
        st = f.filter(workload, node)
        if not st.ok:
            return st
    return OK
