"""The deployment controller: desired placements against reported partitions.

Pure: the scheduler is an injected function, time is a parameter, and every
effect is a returned command (deploy, undeploy, persist). One owner thread
drives it.

Lifecycle of one partition assignment (``Phase``)::

    PENDING --deploy sent--> DEPLOYING --ack ok / reported running--> RUNNING
    DEPLOYING --no ack by the deadline / NACK--> PENDING (backoff) ... --too many--> repair elsewhere
    UNCONFIRMED (loaded after a restart) --reported running--> RUNNING
    any --device lost--> LOST --repair--> a new PENDING assignment (same segments, other device)

Repair keeps the cut points: a lost partition is re-placed as a one-partition
sub-chain between its neighbours, so the healthy partitions of the chain, its
other replicas and every other workload stay where they are. When no device
can take it, the workload is re-planned whole (the scheduler may preempt).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence, Union

from runtime.messages import Hop, PartitionStatus

from ..placement.model import (
    ChainProfile, Fleet, PartitionPlacement, Plan, Quota, ReplicaPlacement, Workload,
    WorkloadPlacement,
)

__all__ = [
    "Phase", "PartKey", "Assignment", "WorkloadEntry", "ControllerConfig", "Controller",
    "DeployPartition", "UndeployPartition", "Persist", "Command", "ScheduleFn", "sub_profile",
]

PartKey = tuple[str, int, int, int]  # workload, version, replica, index
AWAIT_BUILD = "await-build"  # sha256 placeholder of a re-planned key until its artifact is built
ScheduleFn = Callable[..., Plan]  # schedule(fleet, workloads, current=..., quotas=...) -> Plan


class Phase(enum.Enum):
    PENDING = "pending"
    DEPLOYING = "deploying"
    RUNNING = "running"
    UNCONFIRMED = "unconfirmed"
    LOST = "lost"


# ------------------------------------------------------------------ commands


@dataclass(frozen=True, slots=True)
class DeployPartition:
    """Build (or take from cache) the artifact of segments first..last and send a signed Deploy."""

    command_id: str
    device: str
    workload: str
    version: int
    replica: int
    index: int
    first: int
    last: int
    attempt: int


@dataclass(frozen=True, slots=True)
class UndeployPartition:
    command_id: str
    device: str
    workload: str
    version: int
    replica: int
    index: int


@dataclass(frozen=True, slots=True)
class Persist:
    """The assignments of this workload changed: write them to the store."""

    workload: str


Command = Union[DeployPartition, UndeployPartition, Persist]


# ------------------------------------------------------------------ state


@dataclass(slots=True)
class Assignment:
    key: PartKey
    device: str
    first: int
    last: int
    phase: Phase = Phase.PENDING
    sha256: str = ""
    command_id: str = ""
    attempts: int = 0
    next_try: float = 0.0
    deadline: float = math.inf
    running_since: float = math.nan
    lost_at: float = math.nan  # when the partition this one replaces was detected lost
    excluded: frozenset[str] = frozenset()
    reason: str = ""

    @property
    def workload(self) -> str:
        return self.key[0]

    @property
    def replica(self) -> int:
        return self.key[2]

    @property
    def index(self) -> int:
        return self.key[3]


@dataclass(slots=True)
class WorkloadEntry:
    spec: Workload
    version: int
    status: str = "pending"  # pending | deploying | running | degraded
    reasons: dict[str, str] = field(default_factory=dict)
    detail: dict[str, object] = field(default_factory=dict)
    replicas: tuple[ReplicaPlacement, ...] = ()  # desired, as last planned (costs for status)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    ack_timeout_s: float = 5.0
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_attempts: int = 4           # then re-place elsewhere
    replan_interval_s: float = 5.0  # retry pending workloads this often (and on fleet changes)
    startup_wait_s: float = 10.0    # after a restart, at most this long to hear from devices
    orphan_grace_s: float = 3.0     # a reported partition we do not know is undeployed after this
    missing_grace_s: float = 2.0    # a RUNNING partition absent from fresh reports for this long is redeployed


def sub_profile(profile: ChainProfile, first: int, last: int) -> ChainProfile:
    """The chain profile of segments first..last as a model of its own."""
    inp = profile.input_bytes if first == 0 else profile.segments[first - 1].out_bytes
    return ChainProfile(f"{profile.model}[{first}:{last}]", inp, profile.segments[first:last + 1])


class Controller:
    """Reconciles desired workloads with what devices run; see the module docstring."""

    def __init__(self, schedule: ScheduleFn, config: ControllerConfig | None = None, *,
                 command_prefix: str = "c", ready: bool = True) -> None:
        self.schedule = schedule
        self.config = config or ControllerConfig()
        self.prefix = command_prefix
        self.workloads: dict[str, WorkloadEntry] = {}
        self.quotas: dict[str, Quota] = {}
        self.assignments: dict[PartKey, Assignment] = {}
        self.ready = ready
        self.ready_at = -math.inf
        self.started_at = 0.0
        self.evicted: dict[str, float] = {}  # workload -> when it was last preempted
        self.metrics: dict[str, float] = {"utilization": 0.0, "fragmentation": 0.0}
        self.recoveries: list[float] = []  # detection of a loss -> replacement running (s)
        self.deploy_latencies: list[float] = []  # first send -> running (s)
        self.counters: dict[str, int] = {"deploys": 0, "undeploys": 0, "retries": 0, "nacks": 0,
                                          "repairs": 0, "repair_fallbacks": 0, "plans": 0,
                                          "adopted": 0, "orphans": 0}
        self._seq = 0
        self._need_plan = True
        self._last_plan = -math.inf
        self._pending_undeploy: list[UndeployPartition] = []
        self._orphans_seen: dict[tuple[str, PartKey], float] = {}
        self._missing_since: dict[PartKey, float] = {}
        self._first_sent: dict[PartKey, float] = {}
        self._by_command: dict[str, PartKey] = {}
        self._fallback_lost_at = math.nan

    # ------------------------------------------------------------ inputs

    def start_after_restart(self, now: float, stored: Iterable[Assignment]) -> None:
        """Adopt stored assignments as UNCONFIRMED and hold scheduling until devices are heard."""
        for a in stored:
            if a.key[0] in self.workloads and self.workloads[a.key[0]].version == a.key[1]:
                a.phase = Phase.UNCONFIRMED
                self.assignments[a.key] = a
                self.counters["adopted"] += 1
        self.ready = False
        self.started_at = now
        self.ready_at = now + self.config.startup_wait_s

    def set_workload(self, spec: Workload, version: int) -> list[Command]:
        """Add or replace a workload (a new version undeploys the old partitions)."""
        out: list[Command] = []
        old = self.workloads.get(spec.name)
        if old is not None and old.version != version:
            out.extend(self._drop_workload(spec.name))
        entry = self.workloads.get(spec.name)
        if entry is None or entry.version != version:
            self.workloads[spec.name] = WorkloadEntry(spec, version)
        else:
            entry.spec = spec
        self._need_plan = True
        return out

    def remove_workload(self, name: str) -> list[Command]:
        out = self._drop_workload(name)
        self.workloads.pop(name, None)
        self._need_plan = True
        return out

    def set_quotas(self, quotas: Mapping[str, Quota]) -> None:
        self.quotas = dict(quotas)
        self._need_plan = True

    def device_joined(self, device_id: str) -> None:
        self._need_plan = any(e.status == "pending" for e in self.workloads.values()) or self._need_plan

    def device_lost(self, device_id: str, now: float) -> None:
        for a in self.assignments.values():
            if a.device == device_id and a.phase is not Phase.LOST:
                a.phase = Phase.LOST
                a.lost_at = now
                a.reason = "device lost"

    def ack(self, command_id: str, device_id: str, ok: bool, reason: str, now: float) -> list[Command]:
        key = self._by_command.pop(command_id, None)
        a = self.assignments.get(key) if key is not None else None
        if a is None or a.command_id != command_id or a.device != device_id:
            return []  # an ack of an undeploy, of a superseded attempt, or of a forged id
        if ok:
            self._mark_running(a, now)
            self._update_status()
            return []
        self.counters["nacks"] += 1
        a.reason = f"NACK from {device_id}: {reason}"
        return self._retry_or_move(a, now)

    def note_sha(self, key: PartKey, sha256: str) -> None:
        a = self.assignments.get(key)
        if a is not None:
            a.sha256 = sha256

    # ------------------------------------------------------------ the loop

    def reconcile(self, fleet: Fleet, reported: Mapping[str, Sequence[PartitionStatus]],
                  now: float) -> list[Command]:
        """One pass: observe reports, repair losses, (re)plan, send due deploys."""
        out: list[Command] = []
        out.extend(self._observe(fleet, reported, now))
        if not self.ready:
            if now < self.ready_at and not self._all_confirmed_or_heard(fleet, reported):
                return out
            self.ready = True
            for a in self.assignments.values():
                if a.phase is Phase.UNCONFIRMED:
                    dev = fleet.get(a.device)
                    a.phase = Phase.PENDING if dev is not None and dev.alive else Phase.LOST
                    a.lost_at = now
                    a.reason = "not reported after restart"
            self._need_plan = True
        alive = fleet.cache.get("alive_ids")
        if alive is None:  # derived from the immutable snapshot: computed once per snapshot
            alive = fleet.cache["alive_ids"] = frozenset(d.id for d in fleet.devices if d.alive)
        for a in self.assignments.values():
            if a.phase is not Phase.LOST and a.device not in alive:
                a.phase, a.lost_at, a.reason = Phase.LOST, now, "device not alive"
        self._expire(now)
        out.extend(self._repair(fleet, now))
        if self._need_plan or (now - self._last_plan >= self.config.replan_interval_s
                               and any(e.status == "pending" for e in self.workloads.values())):
            out.extend(self._plan(fleet, now))
        out.extend(self._send_due(now))
        out.extend(self._pending_undeploy)
        self._pending_undeploy = []
        self._update_status()
        return out

    def next_deadline(self) -> float:
        best = math.inf
        for a in self.assignments.values():
            if a.phase is Phase.PENDING:
                best = min(best, a.next_try)
            elif a.phase is Phase.DEPLOYING:
                best = min(best, a.deadline)
        if not self.ready:
            best = min(best, self.ready_at)
        return best

    # ------------------------------------------------------------ views

    def chains(self, workload: str) -> list[tuple[int, tuple[Hop, ...]]]:
        """Healthy replica chains (every partition RUNNING), primary (lowest replica) first."""
        entry = self.workloads.get(workload)
        if entry is None:
            return []
        return self._chains_of(workload, entry, [a for a in self.assignments.values()
                                                 if a.key[0] == workload and a.key[1] == entry.version])

    def _chains_of(self, workload: str, entry: WorkloadEntry,
                   mine: Sequence[Assignment]) -> list[tuple[int, tuple[Hop, ...]]]:
        """``chains`` over ``mine``: the workload's assignments of its version, in dict order."""
        by_rep: dict[int, list[Assignment]] = {}
        for a in mine:
            by_rep.setdefault(a.replica, []).append(a)
        out = []
        nseg = len(entry.spec.profile.segments) if entry.spec.profile is not None else -1
        for r in sorted(by_rep):
            parts = sorted(by_rep[r], key=lambda a: a.index)
            if not parts or any(a.phase is not Phase.RUNNING for a in parts):
                continue
            if parts[0].first != 0 or parts[-1].last != nseg - 1 or \
                    any(p.first != q.last + 1 for q, p in zip(parts, parts[1:])):
                continue  # a chain in the middle of a re-plan: not complete
            out.append((r, tuple(Hop(a.device, workload, entry.version, r, a.index) for a in parts)))
        return out

    def _by_workload(self, *, skip_lost: bool = False) -> dict[str, list[Assignment]]:
        """Assignments of each workload's current version, in dict order (one pass, not one per workload)."""
        out: dict[str, list[Assignment]] = {}
        workloads = self.workloads
        for a in self.assignments.values():
            if skip_lost and a.phase is Phase.LOST:
                continue
            e = workloads.get(a.key[0])
            if e is not None and a.key[1] == e.version:
                out.setdefault(a.key[0], []).append(a)
        return out

    def assignments_of(self, workload: str) -> list[Assignment]:
        entry = self.workloads.get(workload)
        v = entry.version if entry is not None else -1
        return sorted((a for a in self.assignments.values() if a.key[0] == workload and a.key[1] == v),
                      key=lambda a: a.key)

    def reserved(self, reported: Mapping[str, Sequence[PartitionStatus]]) -> dict[str, float]:
        """Memory of our partitions that each device already counts in its reported free memory."""
        out: dict[str, float] = {}
        for dev, parts in reported.items():
            for p in parts:
                a = self.assignments.get((p.workload, p.version, p.replica, p.index))
                entry = self.workloads.get(p.workload)
                if a is None or a.device != dev or entry is None or entry.spec.profile is None:
                    continue
                out[dev] = out.get(dev, 0.0) + entry.spec.profile.memory_of(a.first, a.last)
        return out

    # ------------------------------------------------------------ internals

    def _cmd_id(self) -> str:
        self._seq += 1
        return f"{self.prefix}-{self._seq}"

    def _all_confirmed_or_heard(self, fleet: Fleet, reported: Mapping[str, Sequence[PartitionStatus]]) -> bool:
        """Every device a stored assignment names, and every source and sink, has reported."""
        for a in self.assignments.values():
            if a.phase is Phase.UNCONFIRMED and a.device not in reported:
                return False
        for e in self.workloads.values():
            if e.spec.source not in reported or e.spec.sink not in reported:
                return False
        return True

    def _mark_running(self, a: Assignment, now: float) -> None:
        if a.phase is Phase.RUNNING:
            return
        a.phase = Phase.RUNNING
        a.running_since = now
        a.reason = ""
        sent = self._first_sent.pop(a.key, None)
        if sent is not None:
            self.deploy_latencies.append(now - sent)
        if not math.isnan(a.lost_at):
            self.recoveries.append(now - a.lost_at)
            a.lost_at = math.nan

    def _observe(self, fleet: Fleet, reported: Mapping[str, Sequence[PartitionStatus]],
                 now: float) -> list[Command]:
        out: list[Command] = []
        seen: set[PartKey] = set()
        for dev, parts in reported.items():
            for p in parts:
                key = (p.workload, p.version, p.replica, p.index)
                a = self.assignments.get(key)
                if a is not None and a.device == dev and a.sha256 == AWAIT_BUILD:
                    continue  # the old partition under a re-planned key: neither ours nor an orphan
                mine = a is not None and a.device == dev and (not a.sha256 or a.sha256 == p.sha256)
                if not mine:
                    if self.ready:
                        out.extend(self._orphan(dev, key, now))
                    continue
                assert a is not None
                seen.add(key)
                self._orphans_seen.pop((dev, key), None)
                if p.health == "running" and a.phase in (Phase.DEPLOYING, Phase.UNCONFIRMED, Phase.PENDING):
                    if not a.sha256:
                        a.sha256 = p.sha256
                    self._mark_running(a, now)
                elif p.health == "failed" and a.phase is Phase.RUNNING:
                    a.reason = f"reported failed by {dev}"
                    a.attempts = 0
                    out.extend(self._retry_or_move(a, now))
        # A RUNNING partition its (live, reporting) device no longer lists: it lost it (restart).
        for a in self.assignments.values():
            if a.phase is not Phase.RUNNING or a.key in seen or a.device not in reported:
                self._missing_since.pop(a.key, None)
                continue
            since = self._missing_since.setdefault(a.key, now)
            if now - since >= self.config.missing_grace_s and now - a.running_since >= self.config.missing_grace_s:
                self._missing_since.pop(a.key, None)
                a.phase, a.attempts, a.next_try = Phase.PENDING, 0, now
                a.reason = "no longer reported by the device"
        return out

    def _orphan(self, dev: str, key: PartKey, now: float) -> list[Command]:
        first = self._orphans_seen.setdefault((dev, key), now)
        if now - first < self.config.orphan_grace_s:
            return []
        self._orphans_seen[(dev, key)] = now + 10 * self.config.orphan_grace_s  # re-send rarely
        self.counters["orphans"] += 1
        return [self._undeploy(dev, key)]

    def _undeploy(self, dev: str, key: PartKey) -> UndeployPartition:
        self.counters["undeploys"] += 1
        return UndeployPartition(self._cmd_id(), dev, *key)

    def _retry_or_move(self, a: Assignment, now: float) -> list[Command]:
        a.attempts += 1
        if a.attempts >= self.config.max_attempts:
            a.excluded = a.excluded | {a.device}
            a.phase, a.lost_at = Phase.LOST, now
            a.reason = f"gave up on {a.device} after {a.attempts} attempts: {a.reason}"
            return []
        a.phase = Phase.PENDING
        a.next_try = now + min(self.config.backoff_s * 2 ** (a.attempts - 1), self.config.backoff_max_s)
        self.counters["retries"] += 1
        return []

    def _drop_workload(self, name: str) -> list[Command]:
        out: list[Command] = []
        for key in [k for k in self.assignments if k[0] == name]:
            a = self.assignments.pop(key)
            if a.phase is not Phase.LOST:
                out.append(self._undeploy(a.device, key))
        out.append(Persist(name))
        return out

    def _current(self) -> dict[str, WorkloadPlacement]:
        """Placements as assigned now (any phase but LOST), per workload with complete replicas."""
        out: dict[str, WorkloadPlacement] = {}
        groups = self._by_workload(skip_lost=True)
        for name in self.workloads:
            reps: dict[int, list[Assignment]] = {}
            for a in groups.get(name, ()):
                reps.setdefault(a.replica, []).append(a)
            if not reps:
                continue
            replicas = []
            for r in sorted(reps):
                parts = sorted(reps[r], key=lambda a: a.index)
                replicas.append(ReplicaPlacement(tuple(PartitionPlacement(a.first, a.last, a.device)
                                                       for a in parts), 0.0, 0.0))
            out[name] = WorkloadPlacement(tuple(replicas))
        return out

    def _used(self, fleet: Fleet, skip: PartKey | None = None) -> dict[str, float]:
        used: dict[str, float] = {}
        for a in self.assignments.values():
            if a.phase is Phase.LOST or a.key == skip:
                continue
            entry = self.workloads.get(a.workload)
            if entry is None or entry.spec.profile is None:
                continue
            used[a.device] = used.get(a.device, 0.0) + entry.spec.profile.memory_of(a.first, a.last)
        return used

    def _repair(self, fleet: Fleet, now: float) -> list[Command]:
        """Re-place every LOST partition on another device, keeping its segments."""
        out: list[Command] = []
        lost = sorted((a for a in self.assignments.values() if a.phase is Phase.LOST), key=lambda a: a.key)
        failed: set[str] = set()
        for a in lost:
            if a.workload in failed:
                continue
            entry = self.workloads.get(a.workload)
            if entry is None or entry.spec.profile is None:
                continue
            self.counters["repairs"] += 1
            dev = self._repair_one(a, entry, fleet)
            if dev is None:
                failed.add(a.workload)
                continue
            old = fleet.get(a.device)
            if old is not None and old.alive:  # given up on a live device: clear what it half-loaded
                self._pending_undeploy.append(self._undeploy(a.device, a.key))
            new = Assignment(a.key, dev, a.first, a.last, lost_at=a.lost_at, excluded=a.excluded,
                             next_try=now)
            self.assignments[a.key] = new
            self._first_sent.pop(a.key, None)
            out.append(Persist(a.workload))
        for name in sorted(failed):
            # No device takes the lost partition with its cuts: re-plan the workload whole.
            if self._serving(name):
                # A healthy replica still serves: never tear it down for the broken one. The lost
                # partitions stay LOST (repaired above as soon as a device can take them); a whole
                # re-plan is tried at the re-plan interval, and keeps what serves if it fails.
                if now - self._last_plan >= self.config.replan_interval_s:
                    self._need_plan = True
                continue
            self.counters["repair_fallbacks"] += 1
            for key in [k for k, x in self.assignments.items() if k[0] == name]:
                x = self.assignments.pop(key)
                if x.phase is not Phase.LOST:
                    self._pending_undeploy.append(self._undeploy(x.device, key))
                elif not math.isnan(x.lost_at):
                    self._fallback_lost_at = x.lost_at
            self._need_plan = True
            out.append(Persist(name))
        return out

    def _repair_one(self, a: Assignment, entry: WorkloadEntry, fleet: Fleet) -> str | None:
        w = entry.spec
        assert w.profile is not None
        mine = [x for x in self.assignments.values() if x.key[0] == w.name and x.key[1] == entry.version]
        same_chain = {x.device for x in mine if x.replica == a.replica and x.key != a.key}
        chain = sorted((x for x in mine if x.replica == a.replica), key=lambda x: x.index)
        pos = [x.key for x in chain].index(a.key)
        src = chain[pos - 1].device if pos > 0 else w.source
        snk = chain[pos + 1].device if pos + 1 < len(chain) else w.sink
        other_domains = set()
        for x in mine:
            if x.replica != a.replica and x.phase is not Phase.LOST:
                d = fleet.get(x.device)
                if d is not None:
                    other_domains.add(d.power_domain)
        used = self._used(fleet, skip=a.key)
        devices = []
        for d in fleet.devices:
            banned = (d.id in same_chain or d.id in a.excluded or d.id == a.device
                      or (w.replicas > 1 and d.power_domain in other_domains))
            u = used.get(d.id, 0.0)
            if not banned and u == 0.0:
                devices.append(d)  # what ``replace`` would build (memory_bytes >= 0): skip the copy
                continue
            devices.append(replace(d, memory_bytes=max(0.0, d.memory_bytes - u), alive=d.alive and not banned))
        if src not in fleet.index or snk not in fleet.index:
            return None
        sub = Workload(name=f"{w.name}#repair", source=src, sink=snk, tenant=w.tenant,
                       priority=w.priority, replicas=1, objective=w.objective, selectors=w.selectors,
                       tolerations=w.tolerations, max_partitions=1,
                       profile=sub_profile(w.profile, a.first, a.last))
        plan = self.schedule(Fleet(tuple(devices)), [sub], current=None, quotas=None)
        res = plan.workloads[0]
        if not res.placed or len(res.replicas[0].partitions) != 1:
            return None
        return res.replicas[0].partitions[0].device

    def _plan(self, fleet: Fleet, now: float) -> list[Command]:
        self._need_plan = False
        self._last_plan = now
        if not self.workloads:
            return []
        self.counters["plans"] += 1
        specs = [e.spec for e in self.workloads.values()]
        plan = self.schedule(fleet, specs, current=self._current(), quotas=self.quotas or None)
        self.metrics = {"utilization": plan.metrics.utilization, "fragmentation": plan.metrics.fragmentation}
        for name in plan.evicted:
            self.evicted[name] = now
        out: list[Command] = []
        lost_at = getattr(self, "_fallback_lost_at", math.nan)
        self._fallback_lost_at = math.nan
        for res in plan.workloads:
            entry = self.workloads[res.name]
            entry.reasons = dict(res.reasons)
            entry.detail = dict(res.detail)
            if res.placed:
                entry.replicas = res.replicas
                out.extend(self._apply(entry, res.replicas, now, lost_at))
            elif res.name in plan.evicted or not self._serving(res.name):
                entry.replicas = ()
                out.extend(self._drop_assignments(res.name))
            # else: it serves but could not be planned now (e.g. its source is away): keep it running
        return out

    def _serving(self, name: str) -> bool:
        return bool(self.chains(name))

    def _drop_assignments(self, name: str) -> list[Command]:
        out: list[Command] = []
        keys = [k for k in self.assignments if k[0] == name]
        for key in keys:
            a = self.assignments.pop(key)
            if a.phase is not Phase.LOST:
                out.append(self._undeploy(a.device, key))
        if keys:
            out.append(Persist(name))
        return out

    def _apply(self, entry: WorkloadEntry, replicas: Sequence[ReplicaPlacement], now: float,
               lost_at: float) -> list[Command]:
        name, version = entry.spec.name, entry.version
        out: list[Command] = []
        want: dict[PartKey, PartitionPlacement] = {}
        for r, rep in enumerate(replicas):
            for i, p in enumerate(rep.partitions):
                want[(name, version, r, i)] = p
        changed = False
        for key in [k for k in self.assignments if k[0] == name and k not in want]:
            a = self.assignments.pop(key)
            changed = True
            if a.phase is not Phase.LOST:
                out.append(self._undeploy(a.device, key))
        for key, p in want.items():
            a = self.assignments.get(key)
            if a is not None and a.device == p.device and a.first == p.first and a.last == p.last:
                continue
            if a is not None and a.phase is not Phase.LOST:
                out.append(self._undeploy(a.device, key))
            # Same key, same device, other segments: that device's reports of the key describe the
            # old partition until the new artifact's sha is known, so they must not count as ours.
            sha = AWAIT_BUILD if a is not None and a.device == p.device else ""
            self.assignments[key] = Assignment(key, p.device, p.first, p.last, sha256=sha, next_try=now,
                                               lost_at=lost_at)
            self._first_sent.pop(key, None)
            changed = True
        if changed:
            out.append(Persist(name))
        return out

    def _expire(self, now: float) -> None:
        for a in self.assignments.values():
            if a.phase is Phase.DEPLOYING and now >= a.deadline:
                a.reason = f"no ack from {a.device} within {self.config.ack_timeout_s:g} s"
                self._by_command.pop(a.command_id, None)
                self._retry_or_move(a, now)

    def _send_due(self, now: float) -> list[Command]:
        out: list[Command] = []
        for a in sorted(self.assignments.values(), key=lambda a: a.key):
            if a.phase is Phase.PENDING and now >= a.next_try:
                a.phase = Phase.DEPLOYING
                a.command_id = self._cmd_id()
                a.deadline = now + self.config.ack_timeout_s
                self._by_command[a.command_id] = a.key
                self._first_sent.setdefault(a.key, now)
                self.counters["deploys"] += 1
                out.append(DeployPartition(a.command_id, a.device, *a.key, a.first, a.last, a.attempts + 1))
        return out

    def _update_status(self) -> None:
        groups = self._by_workload()
        for name, entry in self.workloads.items():
            parts = groups.get(name)
            if not parts:
                entry.status = "pending"
                continue
            healthy = len(self._chains_of(name, entry, parts))
            if healthy == entry.spec.replicas:
                entry.status = "running"
            elif healthy > 0:
                entry.status = "degraded"
            else:
                entry.status = "deploying"
