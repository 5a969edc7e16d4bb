"""Scheduler plugins in the spirit of the Kubernetes scheduling framework.

``filters(ctx)`` is the one registered list, in the order verdicts are taken (the first failing
filter names a device's phrase). Each filter has a per-device ``filter`` (the slow path, which
explains one node) and a numpy ``batch`` over a whole snapshot (the scheduler's fast path); a
property test holds the two equal. Each filter owns its pending sentence (``reason``), so a new
filter, with its phrase and its sentence, is one class added to this module and to ``filters``.

Per-node phrases are fixed (no ids, no numbers) so that ``explain`` can count them into a
histogram; numbers travel in structured detail fields instead.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, ClassVar, Protocol

import numpy as np

from . import explain
from .chain import ChainSolution, DeviceTable, solve_chain
from .model import (
    NO_SCHEDULE_EFFECTS,
    ChainProfile,
    Device,
    Fleet,
    Quota,
    Segment,
    Taint,
    Workload,
)
from .plan import ReplicaPlacement

__all__ = [
    "Code", "Status", "Filter", "NodeView", "Context", "Tally", "filters", "first_failure",
    "first_failures", "pending_reasons", "Alive", "NodeSelector", "TaintToleration",
    "ProviderFit", "EnergyFloor", "NotThrottled", "VerifiedLead", "unmeasured_leads", "PowerDomainSpread",
    "MemoryFit", "QuotaCheck", "ObjectiveScore", "SCORE", "GangPermit", "NOT_ALIVE",
    "SELECTOR_MISMATCH", "UNTOLERATED_TAINT", "BATTERY_LOW", "INSUFFICIENT_MEMORY",
    "DOMAIN_TAKEN", "NO_PROVIDER", "UNVERIFIED", "THROTTLED",
    "GATE_ALIVE", "GATE_SELECTOR", "GATE_TAINT", "GATE_PROVIDERS", "GATE_ENERGY", "GATE_THROTTLED",
    "GATE_VERIFIED", "GATE_ANTI_AFFINITY", "GATE_FIT", "GATE_QUOTA", "GATE_LATENCY",
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

#: Gates: the keys of a pending workload's reasons (``WorkloadResult.reasons``), one per filter
#: (its ``gate``) plus the scheduler's own checks. Readers (the controller, status, metrics) use
#: these names, never the strings.
GATE_ALIVE = "alive"
GATE_SELECTOR = "selector"
GATE_TAINT = "taint"
GATE_PROVIDERS = "providers"
GATE_ENERGY = "energy"
GATE_THROTTLED = "throttled"
GATE_VERIFIED = "verified"
GATE_ANTI_AFFINITY = "anti-affinity"
GATE_FIT = "fit"
GATE_QUOTA = "quota"
GATE_LATENCY = "latency"


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


@dataclass(frozen=True, slots=True)
class Context:
    """What the filters of one replica's placement are set up with."""

    battery_floor: float = 0.2
    #: Which replica of the workload is being placed (0: the first, or only, one).
    replica: int = 0
    #: Power domains the earlier replicas of this workload use.
    taken: frozenset[str] = frozenset()
    #: The workload's smallest segment: a device with less free memory hosts nothing.
    min_bytes: float = 0.0
    #: The first replica only on measured devices (the scheduler tries that first, and lets
    #: unmeasured ones lead only when no measured device can: a fresh site must start somewhere).
    measured_lead: bool = True


@dataclass(frozen=True, slots=True)
class Tally:
    """What a filter's pending sentence may say: the verdicts over the snapshot."""

    total: int
    fits: int
    #: Devices per first-failing phrase.
    counts: Mapping[str, int]
    hist: tuple[tuple[str, int], ...]
    replica: int
    #: Free bytes of the devices every filter but the memory one (the last) let through.
    free_eligible: np.ndarray


@dataclass(frozen=True, slots=True)
class Examples:
    """Devices a filter passes and fails, as changes to ``EXAMPLE_DEVICE`` (``dataclasses.replace``
    keyword arguments), judged for ``EXAMPLE_WORKLOAD`` under ``EXAMPLE_CONTEXT`` with free bytes
    equal to the device's memory. tests/fog_broker/test_plugin_paths.py checks each filter's
    ``filter`` and ``batch`` on them and draws them into its random fleets, so a new filter is
    covered by declaring its examples, with no edit to the test."""

    passes: tuple[Mapping[str, Any], ...]
    fails: tuple[Mapping[str, Any], ...]


class Filter(Protocol):
    #: Devices it passes and fails (see ``Examples``): every filter declares some of each.
    examples: ClassVar[Examples]

    @property
    def name(self) -> str: ...

    @property
    def gate(self) -> str:
        """Key of the pending reason this filter writes (``WorkloadResult.reason_map``)."""
        ...

    @property
    def phrase(self) -> str:
        """The per-device phrase counted into the histogram."""
        ...

    def filter(self, workload: Workload, node: NodeView) -> Status: ...

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        """One boolean per device of ``fleet``: the verdict of ``filter`` (True passes)."""
        ...

    def key(self, workload: Workload) -> Hashable | None:
        """What the verdict depends on besides the snapshot; None: not cacheable (free memory)."""
        ...

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        """The pending sentence, worded for the person who can act; None: nothing to say."""
        ...


@dataclass(frozen=True, slots=True)
class _Columns:
    """The device flags the filters read, as numpy columns: one pass over a snapshot, once."""

    alive: np.ndarray
    throttled: np.ndarray
    verified: np.ndarray
    measured: np.ndarray
    #: Has a taint with a no-schedule effect (only those devices need the per-device check).
    tainted: np.ndarray
    on_battery: np.ndarray
    charging: np.ndarray
    level: np.ndarray

    @staticmethod
    def of(fleet: Fleet) -> _Columns:
        hit: _Columns | None = fleet.cache.get("filter-columns")
        if hit is None:
            devs, n = fleet.devices, len(fleet.devices)
            alive, throttled, verified = np.ones(n, bool), np.zeros(n, bool), np.ones(n, bool)
            measured = np.ones(n, bool)
            tainted, on_battery = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
            charging, level = np.zeros(n, dtype=bool), np.zeros(n)
            # One pass finds the few devices that are not plain (the common one passes all).
            for i in [i for i, d in enumerate(devs) if not d.alive or d.throttled
                      or not d.verified or not d.measured or d.taints or d.battery is not None]:
                d = devs[i]
                alive[i], throttled[i], verified[i] = d.alive, d.throttled, d.verified
                measured[i] = d.measured
                tainted[i] = any(t.effect in NO_SCHEDULE_EFFECTS for t in d.taints)
                if d.battery is not None:
                    on_battery[i], charging[i], level[i] = True, d.battery.charging, d.battery.level
            hit = _Columns(alive, throttled, verified, measured, tainted, on_battery, charging, level)
            for c in (alive, throttled, verified, measured, tainted, on_battery, charging, level):
                c.setflags(write=False)
            fleet.cache["filter-columns"] = hit
        return hit


def unmeasured_leads(fleet: Fleet) -> bool:
    """True when some device could lead only once unmeasured ones may (verified, not measured)."""
    cols = _Columns.of(fleet)
    return bool((cols.verified & ~cols.measured).any())


def _each(fleet: Fleet, ok: Callable[[Device], bool]) -> np.ndarray:
    return np.fromiter((ok(d) for d in fleet.devices), dtype=bool, count=len(fleet.devices))


def _fail(plugin: Filter, code: Code = Code.UNFIT_FINAL) -> Status:
    return Status(code, (plugin.phrase,), plugin.name)


class Alive:
    examples: ClassVar[Examples] = Examples(passes=({},), fails=({"alive": False},))

    name = "Alive"
    gate = GATE_ALIVE
    phrase = NOT_ALIVE

    def filter(self, workload: Workload, node: NodeView) -> Status:
        return OK if node.device.alive else _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        return _Columns.of(fleet).alive

    def key(self, workload: Workload) -> Hashable | None:
        return ()

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        n = tally.counts.get(self.phrase, 0)
        return f"{n} of {tally.total} devices not alive" if n else None


class NodeSelector:
    examples: ClassVar[Examples] = Examples(
        passes=({}, {"labels": {"zone": "x", "rack": "y"}}),
        fails=({"labels": {}}, {"labels": {"zone": "y"}}))

    name = "NodeSelector"
    gate = GATE_SELECTOR
    phrase = SELECTOR_MISMATCH

    @staticmethod
    def _ok(workload: Workload, d: Device) -> bool:
        return all(d.labels.get(k) == v for k, v in workload.selectors)

    def filter(self, workload: Workload, node: NodeView) -> Status:
        return OK if self._ok(workload, node.device) else _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        if not workload.selectors:
            return np.ones(len(fleet.devices), dtype=bool)
        return _each(fleet, lambda d: self._ok(workload, d))

    def key(self, workload: Workload) -> Hashable | None:
        return workload.selectors

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        n = tally.counts.get(self.phrase, 0)
        if not n:
            return None
        sel = ",".join(f"{k}={v}" for k, v in workload.selectors)
        if n >= tally.total - tally.counts.get(NOT_ALIVE, 0):
            return f"no alive device matches selector {sel}"
        return f"{n} devices do not match selector {sel}"


class TaintToleration:
    examples: ClassVar[Examples] = Examples(
        passes=({}, {"taints": (Taint("edge", "", "PreferNoSchedule"),)}),
        fails=({"taints": (Taint("gpu", "t", "NoSchedule"),)},
               {"taints": (Taint("gpu", "u", "NoExecute"),)}))

    name = "TaintToleration"
    gate = GATE_TAINT
    phrase = UNTOLERATED_TAINT

    @staticmethod
    def _ok(workload: Workload, d: Device) -> bool:
        return not any(t.effect in NO_SCHEDULE_EFFECTS
                       and not any(tol.tolerates(t) for tol in workload.tolerations)
                       for t in d.taints)

    def filter(self, workload: Workload, node: NodeView) -> Status:
        return OK if self._ok(workload, node.device) else _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        tainted = _Columns.of(fleet).tainted
        ok = ~tainted
        for i in np.flatnonzero(tainted).tolist():
            ok[i] = self._ok(workload, fleet.devices[i])
        return ok

    def key(self, workload: Workload) -> Hashable | None:
        return workload.tolerations

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        n = tally.counts.get(self.phrase, 0)
        return f"{n} devices have a taint the workload does not tolerate" if n else None


class ProviderFit:
    """Accelerator selector: a workload naming providers runs only where one is offered.

    A device that reported no providers is taken to run the CPU provider only.
    """

    examples: ClassVar[Examples] = Examples(
        passes=({}, {"providers": ("CPUExecutionProvider", "CUDAExecutionProvider")}),
        fails=({"providers": ()}, {"providers": ("CPUExecutionProvider",)}))
    name = "ProviderFit"
    gate = GATE_PROVIDERS
    phrase = NO_PROVIDER

    @staticmethod
    def _ok(workload: Workload, d: Device) -> bool:
        offered = d.providers or ("CPUExecutionProvider",)
        return any(p in offered for p in workload.providers)

    def filter(self, workload: Workload, node: NodeView) -> Status:
        if not workload.providers or self._ok(workload, node.device):
            return OK
        return _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        if not workload.providers:
            return np.ones(len(fleet.devices), dtype=bool)
        return _each(fleet, lambda d: self._ok(workload, d))

    def key(self, workload: Workload) -> Hashable | None:
        return workload.providers

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        n = tally.counts.get(self.phrase, 0)
        return (f"{n} devices offer none of the execution providers "
                f"{','.join(workload.providers)}") if n else None


@dataclass(frozen=True, slots=True)
class EnergyFloor:
    """A battery device below ``floor`` (charge fraction) and not charging takes no new work."""

    examples: ClassVar[Examples] = Examples(
        passes=({}, {"battery_capacity_wh": 10.0, "battery_level": 0.1, "charging": True},
                {"battery_capacity_wh": 10.0, "battery_level": 0.5}),
        fails=({"battery_capacity_wh": 10.0, "battery_level": 0.1},
               {"battery_capacity_wh": 10.0, "battery_level": 0.0}))
    floor: float = 0.2
    name: str = "EnergyFloor"
    gate: str = GATE_ENERGY
    phrase: str = BATTERY_LOW

    def _ok(self, d: Device) -> bool:
        b = d.battery
        return b is None or b.charging or b.level >= self.floor

    def filter(self, workload: Workload, node: NodeView) -> Status:
        return OK if self._ok(node.device) else _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        c = _Columns.of(fleet)
        return np.asarray(~c.on_battery | c.charging | (c.level >= self.floor), dtype=bool)

    def key(self, workload: Workload) -> Hashable | None:
        return self.floor

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        n = tally.counts.get(self.phrase, 0)
        return (f"{n} devices on battery below {self.floor:.0%} and not charging") if n else None


class NotThrottled:
    """A device reporting thermal throttling takes no partition; what it runs is re-placed.

    Its segment times no longer hold, so it fails the plan; the workload stays pending with this
    reason if no other device fits. Usable again once it reports unthrottled.
    """

    examples: ClassVar[Examples] = Examples(passes=({},), fails=({"throttled": True},))
    name = "NotThrottled"
    gate = GATE_THROTTLED
    phrase = THROTTLED

    def filter(self, workload: Workload, node: NodeView) -> Status:
        return OK if not node.device.throttled else _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        return ~_Columns.of(fleet).throttled

    def key(self, workload: Workload) -> Hashable | None:
        return ()

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        n = tally.counts.get(self.phrase, 0)
        return (f"{n} devices report thermal throttling and take no partition until they "
                f"stop") if n else None


@dataclass(frozen=True, slots=True)
class VerifiedLead:
    """A device whose capacity claim is flagged holds no first (or only) replica of anything,
    nor does one the fog has not measured yet (``measured_lead``).

    Its claim decides nothing a workload cannot survive losing: it may serve replica 1 and
    later, never the one every request goes to first.
    """

    examples: ClassVar[Examples] = Examples(passes=({},), fails=({"verified": False},))
    replica: int = 0
    measured_lead: bool = True
    name: str = "VerifiedLead"
    gate: str = GATE_VERIFIED
    phrase: str = UNVERIFIED

    def filter(self, workload: Workload, node: NodeView) -> Status:
        d = node.device
        if self.replica > 0 or (d.verified and (d.measured or not self.measured_lead)):
            return OK
        return _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        if self.replica > 0:
            return np.ones(len(fleet.devices), dtype=bool)
        cols = _Columns.of(fleet)
        return cols.verified & cols.measured if self.measured_lead else cols.verified

    def key(self, workload: Workload) -> Hashable | None:
        return (self.replica > 0, self.measured_lead)

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        n = tally.counts.get(self.phrase, 0)
        return (f"{n} devices have flagged (or not yet measured) capacity claims and hold no first "
                f"replica") if n else None


@dataclass(frozen=True, slots=True)
class PowerDomainSpread:
    """Anti-affinity: a further replica avoids every power domain an earlier replica uses.

    Stricter than per-partition anti-affinity, so it holds whatever the replicas' cuts are.
    """

    examples: ClassVar[Examples] = Examples(
        passes=({}, {"labels": (("zone", "x"),)}),
        fails=({"labels": (("zone", "x"), ("power-domain", "p0"))},))
    taken: frozenset[str] = field(default_factory=frozenset)
    name: str = "PowerDomainSpread"
    gate: str = GATE_ANTI_AFFINITY
    phrase: str = DOMAIN_TAKEN

    def filter(self, workload: Workload, node: NodeView) -> Status:
        return OK if node.device.power_domain not in self.taken else _fail(self)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        if not self.taken:
            return np.ones(len(fleet.devices), dtype=bool)
        hit = fleet.cache.get("domains")
        if hit is None:  # each device's power domain as a small integer code, once per snapshot
            codes: dict[str, int] = {}
            arr = np.array([codes.setdefault(d.power_domain, len(codes)) for d in fleet.devices],
                           dtype=np.int64)
            arr.setflags(write=False)
            hit = fleet.cache["domains"] = (arr, codes)
        arr, codes = hit
        return ~np.isin(arr, [codes[t] for t in self.taken if t in codes])

    def key(self, workload: Workload) -> Hashable | None:
        return None

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        if tally.replica == 0:
            return None
        return (f"replica {tally.replica + 1} of {workload.replicas}: no chain on power domains "
                f"unused by the other replicas")


@dataclass(frozen=True, slots=True)
class MemoryFit:
    """A device that cannot hold even the smallest segment can host no partition at all.

    Last in ``filters``: its sentence, the ``fit`` line, sums up every verdict.
    """

    examples: ClassVar[Examples] = Examples(
        passes=({}, {"memory_bytes": 1e6}), fails=({"memory_bytes": 0.0}, {"memory_bytes": 999_999.0}))
    min_bytes: float = 0.0
    name: str = "MemoryFit"
    gate: str = GATE_FIT
    phrase: str = INSUFFICIENT_MEMORY

    def filter(self, workload: Workload, node: NodeView) -> Status:
        return OK if node.free_bytes >= self.min_bytes else _fail(self, Code.UNFIT)

    def batch(self, workload: Workload, fleet: Fleet, free: np.ndarray) -> np.ndarray:
        return np.asarray(free >= self.min_bytes, dtype=bool)

    def key(self, workload: Workload) -> Hashable | None:
        return None

    def reason(self, workload: Workload, tally: Tally) -> str | None:
        assert workload.profile is not None
        need = workload.profile.memory_of(0, len(workload.profile.segments) - 1)
        efree = tally.free_eligible
        largest = float(efree.max()) if len(efree) else 0.0
        total_free = float(efree.sum()) if len(efree) else 0.0
        sentence = explain.memory_sentence(need, largest, total_free, tally.fits)
        if workload.min_partitions > 1:
            sentence += f" (min_partitions {workload.min_partitions})"
        if workload.max_partitions is not None:
            sentence += f" (max_partitions {workload.max_partitions})"
        return f"{explain.fit_summary(tally.total, tally.fits, tally.hist)}; {sentence}"


#: What every filter's ``examples`` are judged against: a plain device that passes them all, a
#: workload that selects ``zone=x``, wants CUDA and tolerates nothing, and a context with a 20 %
#: battery floor, the first replica, power domain ``p0`` taken and a 1 MB smallest segment.
EXAMPLE_DEVICE = Device(id="example", flops=1e10, memory_bytes=10**9, uplink_bps=1e8, downlink_bps=1e8,
                        rtt_s=0.0, power_active_w=0.0, power_idle_w=0.0,
                        labels={"zone": "x", "power-domain": "p1"},
                        providers=("CUDAExecutionProvider",))
EXAMPLE_WORKLOAD = Workload("example", "example", "example", selectors=(("zone", "x"),),
                            providers=("CUDAExecutionProvider",), profile=ChainProfile(
                                "example", 1e3, (Segment("s0", 1e8, 9e5, 1e5, 1e3),)))
EXAMPLE_CONTEXT = Context(battery_floor=0.2, replica=0, taken=frozenset({"p0"}), min_bytes=1e6)


@functools.lru_cache(maxsize=1024)
def filters(ctx: Context) -> tuple[Filter, ...]:
    """The registered filters, in the order their verdicts are taken; the memory one last.

    Plugins hold no state beyond their settings, so one tuple serves every equal context."""
    return (Alive(), NodeSelector(), TaintToleration(), ProviderFit(),
            EnergyFloor(ctx.battery_floor), NotThrottled(), VerifiedLead(ctx.replica, ctx.measured_lead),
            PowerDomainSpread(ctx.taken), MemoryFit(ctx.min_bytes))


def first_failure(filters: Sequence[Filter], workload: Workload, node: NodeView) -> Status:
    """The first failing filter's status (Kubernetes stops at the first one per node)."""
    for f in filters:
        st = f.filter(workload, node)
        if not st.ok:
            return st
    return OK


def first_failures(masks: Sequence[np.ndarray]) -> np.ndarray:
    """Per device, the index of the first failing filter's mask (``batch``); -1 where all pass."""
    n = len(masks[0]) if masks else 0
    out = np.full(n, -1, dtype=np.int64)
    for i, m in enumerate(masks):
        out[(out < 0) & ~m] = i
    return out


def pending_reasons(fs: Sequence[Filter], workload: Workload, first: np.ndarray,
                    free: np.ndarray, replica: int) -> tuple[tuple[tuple[str, str], ...], Tally]:
    """Each filter's sentence (in list order) for a replica no chain could be found for.

    ``first`` is each device's first failing filter (an index into ``fs``, -1: fits).
    """
    hist = explain.histogram(fs[i].phrase for i in first[first >= 0].tolist())
    counts = dict(hist)
    tally = Tally(len(first), int(np.count_nonzero(first < 0)), counts, hist, replica,
                  free[(first < 0) | (first == len(fs) - 1)])
    out = []
    for f in fs:
        sentence = f.reason(workload, tally)
        if sentence is not None:
            out.append((f.gate, sentence))
    return tuple(out), tally


@dataclass(frozen=True, slots=True)
class QuotaCheck:
    """Tenant memory quota: a pre-filter over the whole gang, not per node."""

    name: str = "Quota"

    def check(self, tenant: str, asked: float, used: float, quota: Quota | None) -> Status:
        if quota is None or used + asked <= quota.memory_bytes:
            return OK
        left = quota.memory_bytes - used
        return Status(Code.UNFIT_FINAL, (explain.quota_sentence(tenant, asked, left),), self.name)


@dataclass(frozen=True, slots=True)
class ObjectiveScore:
    """Score of a chain: the workload's objective under the reference model (lower is better).

    ``score`` reads one placed chain's costs (``cost.chain_cost``, per device: the slow path);
    ``batch`` finds the chain of least score over the eligible devices of the whole table
    (``chain.solve_chain``, vectorised). The property test holds ``batch``'s value equal to
    ``score`` of the chain it returns.
    """

    name: str = "Objective"

    def score(self, workload: Workload, replica: ReplicaPlacement) -> float:
        if workload.objective == "throughput":
            return replica.bottleneck_s
        return replica.energy_j if workload.objective == "energy" else replica.latency_s

    def batch(self, workload: Workload, table: DeviceTable, source: int, sink: int, *,
              free: np.ndarray, eligible: np.ndarray, node_limit: int,
              objective: str | None = None, bounded: bool = True) -> ChainSolution | None:
        assert workload.profile is not None
        return solve_chain(table, workload.profile, source, sink,
                           objective=objective or workload.objective,
                           max_partitions=workload.max_partitions,
                           min_partitions=workload.min_partitions, free=free, eligible=eligible,
                           node_limit=node_limit,
                           max_latency_s=workload.max_latency_s if bounded else None)


#: The registered score: the exact chain solver optimises one objective per solve.
SCORE = ObjectiveScore()


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
