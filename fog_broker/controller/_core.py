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

A new version of a workload switches make-before-break (``Switch``)::

    set_workload(v2)    v1's complete replicas move to the switch and keep serving
                        (``chains`` returns them); v1's broken or unfinished ones go at once
    reconcile ...       v2 is planned next to v1: v1's partitions are not ``reserved``, so
                        the fleet snapshot shows the memory they hold (the scheduler and
                        repairs see it); v2 deploys like any workload
    v2 all replicas     v1's replicas retire: ``chains`` returns v2's from now on, and v1's
      running           partitions are undeployed ``drain_s`` later (requests already routed
                        to them finish); the switch ends once devices stop reporting them

v1 is never repaired or redeployed during a switch: a lost v1 partition takes its
replica out of service (its other partitions go at once), and when no v1 replica
serves any more, requests go to v2's healthy chains as soon as there are any.
v1's and v2's assignments are persisted, so a fog restart adopts both and goes on.

When v2 does not fit next to v1 (and would fit without it), the switch rolls
replica by replica (``ROLLING``): retire one v1 replica (drained), place one v2
replica in its memory (on a replica index v1 does not use, if there is one), wait
until it runs, and again; ``chains`` serves v2's running replicas, then v1's left
(on the other indices), so no step leaves the workload without a serving chain. Only when one v1
replica is left, nothing of v2 runs and not even one v2 replica fits next to it
(``replicas: 1`` at a full site, typically) does it break before making
(``BREAK_BEFORE_MAKE``, after ``switch_break_after_s``): v1 serves up to its
undeploy, without a drain (which would only refuse requests for longer), and
requests are refused with the switch's reason until v2 runs. A rollout that cannot happen at
all is worse than a short gap (the coordinator's release would never serve), but a
gap that cannot help is not taken: if v2 would not fit even without v1, or this
cannot be told (after a restart the old spec is unknown), v1 serves on and the
reason says why.
"""
from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from runtime.messages import Hop, PartitionStatus

from ..placement.model import (
    ChainProfile,
    Device,
    Fleet,
    PartitionPlacement,
    Plan,
    Quota,
    ReplicaPlacement,
    Workload,
    WorkloadPlacement,
)

__all__ = [
    "Phase", "PartKey", "Assignment", "WorkloadEntry", "ControllerConfig", "Controller",
    "DeployPartition", "UndeployPartition", "Persist", "Command", "ScheduleFn", "sub_profile",
    "Switch", "MAKE_BEFORE_BREAK", "ROLLING", "BREAK_BEFORE_MAKE",
]

# Why a partition was lost when its device died (not when the partition failed there): the
# device may take it back once it has rejoined.
_LOST, _NOT_ALIVE, _NOT_REPORTED = "device lost", "device not alive", "not reported after restart"
_DIED = frozenset((_LOST, _NOT_ALIVE, _NOT_REPORTED))

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
class _PartitionCommand:
    """A command to one device about one partition (a ``PartKey``); its ACK names ``command_id``."""

    command_id: str
    device: str
    workload: str
    version: int
    replica: int
    index: int


@dataclass(frozen=True, slots=True)
class DeployPartition(_PartitionCommand):
    """Build (or take from cache) the artifact of segments first..last and send a signed Deploy."""

    first: int
    last: int
    attempt: int


@dataclass(frozen=True, slots=True)
class UndeployPartition(_PartitionCommand):
    """Send an Undeploy: the device unloads the partition."""


@dataclass(frozen=True, slots=True)
class Persist:
    """The assignments of this workload changed: write them to the store."""

    workload: str


Command = DeployPartition | UndeployPartition | Persist


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
    ack_window_s: float = 0.0  # the current attempt's ack window (``Controller._ack_window``)
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
    #: replica chains wanted by ``Controller.scale`` (None: ``spec.replicas``); the spec follows
    #: once a new chain is placed or a drained one is gone
    want: int | None = None
    draining: dict[int, float] = field(default_factory=dict)  # replica -> undeploy at (no new requests)
    scale_reason: str = ""  # why the wanted count is not running (a chain does not fit), or ""
    scale_next_try: float = -math.inf


MAKE_BEFORE_BREAK = "make-before-break"
ROLLING = "rolling"
BREAK_BEFORE_MAKE = "break-before-make"


@dataclass(slots=True)
class Switch:
    """A workload's version change in progress: the old partitions and what happens to them.

    ``parts`` are the old partitions still deployed. Those of ``version`` not in ``retire_at``
    serve (``Controller.chains``) until the new version runs; the others are retired: no new
    request is routed to them and they are undeployed at ``retire_at`` (nan: set by the next
    pass). ``gone`` keeps undeployed ones (and when) until their devices stop reporting them:
    their memory is free then, and their reports are not orphans meanwhile.
    """

    version: int                   # the old version that serves until the new one runs
    segments: int                  # segments of its model (what a complete chain covers)
    spec: Workload | None          # its spec (None when adopted after a restart)
    parts: dict[PartKey, Assignment] = field(default_factory=dict)
    specs: dict[int, Workload] = field(default_factory=dict)  # of every version in ``parts``, when known
    retire_at: dict[PartKey, float] = field(default_factory=dict)
    gone: dict[PartKey, tuple[Assignment, float]] = field(default_factory=dict)
    mode: str = MAKE_BEFORE_BREAK  # | ROLLING | BREAK_BEFORE_MAKE
    since: float = math.nan        # the first pass that saw it
    reason: str = ""               # why it is not plain make-before-break (or why it waits)
    next_try: float = -math.inf    # rolling: the next step after one that could not be taken
    fell_back: bool = False        # went rolling at least once (counted once)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    ack_timeout_s: float = 5.0
    #: a deploy's ack window adds this many times the artifact's transfer over the device's
    #: downlink to ``ack_timeout_s`` (0: the fixed timeout only)
    transfer_safety: float = 2.0
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_attempts: int = 4           # then re-place elsewhere
    replan_interval_s: float = 5.0  # retry pending workloads this often (and on fleet changes)
    startup_wait_s: float = 10.0    # after a restart, at most this long to hear from devices
    orphan_grace_s: float = 3.0     # a reported partition we do not know is undeployed after this
    missing_grace_s: float = 2.0    # a RUNNING partition absent from fresh reports for this long is redeployed
    drain_s: float = 2.0            # a retired old-version partition is undeployed this long after its last request
    # a switch with no room even replica by replica breaks first after this (inf: never)
    switch_break_after_s: float = 0.0


def sub_profile(profile: ChainProfile, first: int, last: int) -> ChainProfile:
    """The chain profile of segments first..last as a model of its own."""
    inp = profile.input_bytes if first == 0 else profile.segments[first - 1].out_bytes
    return ChainProfile(f"{profile.model}[{first}:{last}]", inp, profile.segments[first:last + 1],
                        tuple((k, v[first:last + 1]) for k, v in profile.segment_times))


def _complete(parts: Sequence[Assignment], nseg: int) -> bool:
    """``parts`` (sorted by index) cover segments 0..nseg-1 contiguously."""
    return bool(parts) and parts[0].first == 0 and parts[-1].last == nseg - 1 and \
        all(p.first == q.last + 1 for q, p in itertools.pairwise(parts))


def _by_replica(parts: Iterable[Assignment]) -> dict[int, list[Assignment]]:
    """Assignments grouped by replica, each group sorted by index; replicas in ascending order."""
    by_rep: dict[int, list[Assignment]] = {}
    for a in parts:
        by_rep.setdefault(a.replica, []).append(a)
    return {r: sorted(by_rep[r], key=lambda a: a.index) for r in sorted(by_rep)}


def _chains(workload: str, version: int, nseg: int,
            mine: Iterable[Assignment]) -> list[tuple[int, tuple[Hop, ...]]]:
    """The complete chains of ``mine`` (one version's assignments) whose partitions all run."""
    out = []
    for r, parts in _by_replica(mine).items():
        if any(a.phase is not Phase.RUNNING for a in parts):
            continue
        if not _complete(parts, nseg):
            continue  # a chain in the middle of a re-plan: not complete
        out.append((r, tuple(Hop(a.device, workload, version, r, a.index) for a in parts)))
    return out


class Controller:
    """Reconciles desired workloads with what devices run; see the module docstring."""

    def __init__(self, schedule: ScheduleFn, config: ControllerConfig | None = None, *,
                 command_prefix: str = "c", ready: bool = True) -> None:
        self.schedule = schedule
        self.config = config or ControllerConfig()
        self.prefix = command_prefix
        self.workloads: dict[str, WorkloadEntry] = {}
        self.quotas: dict[str, Quota] = {}
        self.assignments: dict[PartKey, Assignment] = {}  # of each workload's current version
        self.switches: dict[str, Switch] = {}  # workload -> its version change in progress
        self.ready = ready
        self.ready_at = -math.inf
        self.started_at = 0.0
        self.evicted: dict[str, float] = {}  # workload -> when it was last preempted
        self.metrics: dict[str, float] = {"utilization": 0.0, "fragmentation": 0.0}
        self.recoveries: list[float] = []  # detection of a loss -> replacement running (s)
        self.deploy_latencies: list[float] = []  # first send -> running (s)
        self.counters: dict[str, int] = {"deploys": 0, "undeploys": 0, "retries": 0, "nacks": 0,
                                          "repairs": 0, "repair_fallbacks": 0, "plans": 0,
                                          "adopted": 0, "orphans": 0, "switches": 0, "switches_rolling": 0,
                                          "switches_broken": 0, "retired": 0}
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
        """Adopt stored assignments as UNCONFIRMED and hold scheduling until devices are heard.

        Stored partitions of an older version than the workload's are a switch that was in
        progress: they are adopted into it and serve again (once reported) until the new
        version runs.
        """
        old: dict[str, list[Assignment]] = {}
        for a in stored:
            entry = self.workloads.get(a.key[0])
            if entry is None or a.key[1] > entry.version:
                continue
            a.phase = Phase.UNCONFIRMED
            self.counters["adopted"] += 1
            if a.key[1] == entry.version:
                self.assignments[a.key] = a
            else:
                old.setdefault(a.key[0], []).append(a)
        for name, parts in old.items():
            self.switches[name] = self._adopt_switch(parts)
        for entry in self.workloads.values():  # an autoscaled workload goes on with the chains it had
            auto = entry.spec.autoscale
            reps = {k[2] for k in self.assignments if k[0] == entry.spec.name and k[1] == entry.version}
            n = len(reps)
            if auto is not None and n > entry.spec.replicas and reps == set(range(n)):
                n = min(n, auto.max_replicas)
                entry.spec, entry.want = replace(entry.spec, replicas=n), n
        self.ready = False
        self.started_at = now
        self.ready_at = now + self.config.startup_wait_s

    def set_workload(self, spec: Workload, version: int) -> list[Command]:
        """Add or replace a workload; a new version switches make-before-break (module docstring)."""
        out: list[Command] = []
        old = self.workloads.get(spec.name)
        if old is not None and old.version != version:
            out.extend(self._begin_switch(old))
        entry = self.workloads.get(spec.name)
        if entry is None or entry.version != version:
            self.workloads[spec.name] = WorkloadEntry(spec, version)
        elif entry.want is not None and spec.autoscale is not None:
            # the same version again (a redeploy of the same text): the chains it scaled to stay,
            # within its range; the autoscaler goes on from there
            lo, hi = spec.autoscale.min_replicas, spec.autoscale.max_replicas
            entry.spec = replace(spec, replicas=min(max(entry.spec.replicas, lo), hi))
            if not lo <= entry.want <= hi:
                entry.want = min(max(entry.want, lo), hi)
                for r in range(entry.want, entry.spec.replicas):
                    entry.draining.setdefault(r, -math.inf)
        else:
            entry.spec = spec
            entry.want, entry.scale_reason = None, ""
            entry.draining.clear()
        self._need_plan = True
        return out

    def scale(self, name: str, replicas: int, now: float) -> bool:
        """Want ``replicas`` replica chains of ``name`` without a new version (an autoscaler's step).

        Up: each missing chain is placed alone beside the running ones, through the scheduler
        with its gates (memory, power domains apart from the other replicas, the tenant's quota),
        at the next passes; the running chains stay where they are. Down: the highest replicas
        stop taking requests at once and are undeployed ``drain_s`` later (requests routed to
        them finish). Returns False when ``name`` is unknown or switching versions (not now).
        """
        entry = self.workloads.get(name)
        if entry is None or name in self.switches or replicas < 1:
            return False
        cur = entry.spec.replicas
        entry.want = replicas
        entry.scale_reason = ""
        entry.scale_next_try = now
        # a replica drained but wanted again serves again at once (it never left)
        for r in [r for r in entry.draining if r < replicas]:
            del entry.draining[r]
        for r in range(replicas, cur):
            entry.draining.setdefault(r, now + self.config.drain_s)
        return True

    def wanted_replicas(self, name: str) -> int:
        """The replica chains ``name`` wants now (its autoscaler's count, else its spec's)."""
        entry = self.workloads.get(name)
        if entry is None:
            return 0
        return entry.spec.replicas if entry.want is None else entry.want

    def update_costs(self, name: str, profile: ChainProfile) -> None:
        """Measured costs for a workload's chain: used from the next plan on (a device lost, new work),
        without planning now: nothing that runs moves because a timing came in."""
        entry = self.workloads.get(name)
        if entry is not None and entry.spec.profile is not None:
            entry.spec = replace(entry.spec, profile=profile)

    def remove_workload(self, name: str) -> list[Command]:
        """Delete a workload: every partition of every version goes now (a switch ends with it)."""
        out = self._drop_workload(name)
        sw = self.switches.pop(name, None)
        if sw is not None:
            out.extend(self._undeploy(a.device, a.key) for a in sw.parts.values() if a.phase is not Phase.LOST)
        self.workloads.pop(name, None)
        self._need_plan = True
        return out

    def set_quotas(self, quotas: Mapping[str, Quota]) -> None:
        self.quotas = dict(quotas)
        self._need_plan = True

    def request_plan(self) -> None:
        """Plan at the next reconcile: a device's capacity claim was flagged, so the first replicas
        it holds move (the scheduler's ``VerifiedLead``); nothing else that runs is disturbed."""
        self._need_plan = True

    def device_joined(self, device_id: str) -> None:
        self._need_plan = any(e.status == "pending" for e in self.workloads.values()) or self._need_plan

    def device_lost(self, device_id: str, now: float) -> None:
        for a in self._all_parts():
            if a.device == device_id and a.phase is not Phase.LOST:
                a.phase = Phase.LOST
                a.lost_at = now
                a.reason = _LOST

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
                    a.reason = _NOT_REPORTED
            for sw in self.switches.values():
                for a in sw.parts.values():
                    if a.phase is Phase.UNCONFIRMED:  # an old version is never redeployed
                        a.phase, a.lost_at, a.reason = Phase.LOST, now, _NOT_REPORTED
            self._need_plan = True
        alive = fleet.cache.get("alive_ids")
        if alive is None:  # derived from the immutable snapshot: computed once per snapshot
            alive = fleet.cache["alive_ids"] = frozenset(d.id for d in fleet.devices if d.alive)
        for a in self.assignments.values():
            if a.phase is not Phase.LOST and a.device not in alive:
                a.phase, a.lost_at, a.reason = Phase.LOST, now, _NOT_ALIVE
        for sw in self.switches.values():
            for a in sw.parts.values():
                if a.phase is not Phase.LOST and a.device not in alive:
                    a.phase, a.lost_at, a.reason = Phase.LOST, now, _NOT_ALIVE
        self._expire(now)
        out.extend(self._repair(fleet, now))
        out.extend(self._scale(fleet, now))
        if self._need_plan or (now - self._last_plan >= self.config.replan_interval_s
                               and any(e.status == "pending" for e in self.workloads.values())):
            out.extend(self._plan(fleet, now))
        if self.switches:
            out.extend(self._advance_switches(fleet, now))
        out.extend(self._send_due(fleet, now))
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
        for sw in self.switches.values():
            for t in sw.retire_at.values():
                best = min(best, -math.inf if math.isnan(t) else t)
        for e in self.workloads.values():
            if e.draining:
                best = min(best, min(e.draining.values()))
            if e.want is not None and e.want > e.spec.replicas:
                best = min(best, e.scale_next_try)
        return best

    # ------------------------------------------------------------ views

    def chains(self, workload: str) -> list[tuple[int, tuple[Hop, ...]]]:
        """The chains that serve requests now (every partition RUNNING), primary first.

        The workload's own version's healthy chains, lowest replica first; during a switch
        the old version's until the new one runs (rolling: the new one's, then the old ones'
        left, on other replica indices); when no old chain is left, the new one's.
        """
        entry = self.workloads.get(workload)
        if entry is None:
            return []
        new = self._chains_of(workload, entry, self._mine(workload, entry))
        if entry.draining:
            new = [c for c in new if c[0] not in entry.draining]
        sw = self.switches.get(workload)
        if sw is None:
            return new
        old = self._old_chains(workload, sw)
        if sw.mode == ROLLING:
            taken = {r for r, _ in new}
            return new + [c for c in old if c[0] not in taken]
        return old or new

    def healthy_replicas(self, workload: str) -> int:
        """Healthy chains of the workload's own (newest) version, whatever serves during a switch."""
        entry = self.workloads.get(workload)
        return 0 if entry is None else len(self._chains_of(workload, entry, self._mine(workload, entry)))

    def switch_view(self, workload: str) -> dict[str, object] | None:
        """The switch in progress of ``workload`` for ``fogline status`` (None: none)."""
        sw = self.switches.get(workload)
        entry = self.workloads.get(workload)
        if sw is None or entry is None:
            return None
        serving = self.chains(workload)
        old = []
        for a in sorted(sw.parts.values(), key=lambda a: a.key):
            state = "draining" if a.key in sw.retire_at else "serving"
            old.append({"version": a.key[1], "replica": a.replica, "index": a.index, "device": a.device,
                        "phase": a.phase.value, "state": state})
        for a, _ in sorted(sw.gone.values(), key=lambda g: g[0].key):
            old.append({"version": a.key[1], "replica": a.replica, "index": a.index, "device": a.device,
                        "phase": a.phase.value, "state": "undeployed"})
        return {"from_version": sw.version, "to_version": entry.version, "mode": sw.mode,
                "reason": sw.reason or None,
                "serving_versions": sorted({h[0].version for _, h in serving if h}),
                "old_partitions": old}

    def persisted_of(self, workload: str) -> list[Assignment]:
        """What the store keeps for ``workload``: its assignments and the old ones of a switch."""
        out = self.assignments_of(workload)
        sw = self.switches.get(workload)
        if sw is not None:
            out.extend(sorted(sw.parts.values(), key=lambda a: a.key))
        return out

    def _mine(self, workload: str, entry: WorkloadEntry) -> list[Assignment]:
        return [a for a in self.assignments.values() if a.key[0] == workload and a.key[1] == entry.version]

    def _all_parts(self) -> Iterable[Assignment]:
        """Every assignment: current versions' and the old ones of switches."""
        yield from self.assignments.values()
        for sw in self.switches.values():
            yield from sw.parts.values()

    def _chains_of(self, workload: str, entry: WorkloadEntry,
                   mine: Sequence[Assignment]) -> list[tuple[int, tuple[Hop, ...]]]:
        """``chains`` over ``mine``: the workload's assignments of its version, in dict order."""
        nseg = len(entry.spec.profile.segments) if entry.spec.profile is not None else -1
        return _chains(workload, entry.version, nseg, mine)

    def _old_chains(self, workload: str, sw: Switch) -> list[tuple[int, tuple[Hop, ...]]]:
        """The switch's old chains that serve: of its version, not retired, every partition RUNNING."""
        return _chains(workload, sw.version, sw.segments,
                       [a for k, a in sw.parts.items() if k[1] == sw.version and k not in sw.retire_at])

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
        for a in self._all_parts():
            if a.phase is Phase.UNCONFIRMED and a.device not in reported:
                return False
        return all(e.spec.source in reported and e.spec.sink in reported for e in self.workloads.values())

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
        switches = self.switches
        for dev, parts in reported.items():
            for p in parts:
                key = (p.workload, p.version, p.replica, p.index)
                a = self.assignments.get(key)
                if a is None and switches:
                    sw = switches.get(p.workload)
                    if sw is not None and self._observe_old(sw, dev, key, p, now, seen):
                        continue
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
        if switches:
            self._observe_switches(reported, now, seen)
        return out

    def _observe_old(self, sw: Switch, dev: str, key: PartKey, p: PartitionStatus, now: float,
                     seen: set[PartKey]) -> bool:
        """A reported partition of an older version: True when the switch knows it (not an orphan)."""
        a = sw.parts.get(key)
        if a is not None and a.device == dev and (not a.sha256 or a.sha256 == p.sha256):
            seen.add(key)
            self._orphans_seen.pop((dev, key), None)
            if p.health == "running" and a.phase is Phase.UNCONFIRMED:
                a.phase, a.running_since = Phase.RUNNING, now
                a.sha256 = a.sha256 or p.sha256
            elif p.health == "failed" and a.phase is not Phase.LOST:
                a.phase, a.lost_at, a.reason = Phase.LOST, now, f"reported failed by {dev}"
            return True
        g = sw.gone.get(key)
        if g is not None and g[0].device == dev:
            seen.add(key)  # undeployed, the device has not said so yet
            return True
        return False

    def _observe_switches(self, reported: Mapping[str, Sequence[PartitionStatus]], now: float,
                          seen: set[PartKey]) -> None:
        """Old partitions missing from fresh reports are lost; undeployed ones no longer reported are gone."""
        grace = self.config.missing_grace_s
        gone_timeout = 2 * self.config.orphan_grace_s + grace
        for sw in self.switches.values():
            for a in sw.parts.values():
                if a.phase is not Phase.RUNNING or a.key in seen or a.device not in reported:
                    self._missing_since.pop(a.key, None)
                    continue
                since = self._missing_since.setdefault(a.key, now)
                if now - since >= grace and now - a.running_since >= grace:
                    self._missing_since.pop(a.key, None)
                    a.phase, a.lost_at, a.reason = Phase.LOST, now, "no longer reported by the device"
            for key, (_a, at) in list(sw.gone.items()):
                # Gone from its device's report (its memory is free: plan again), or reported long
                # after the undeploy (the orphan rule takes it over from here).
                if key not in seen or now - at >= gone_timeout:
                    del sw.gone[key]
                    self._need_plan = True

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
            # the device it was lost on only when it died and has come back (a new epoch: nothing
            # of it is left); a partition that failed there, or gave up on it, goes elsewhere
            banned = (d.id in same_chain or d.id in a.excluded
                      or (d.id == a.device and a.reason not in _DIED)
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

        def place(candidates: list[Device]) -> str | None:
            plan = self.schedule(Fleet(tuple(candidates)), [sub], current=None, quotas=None)
            res = plan.workloads[0]
            if not res.placed or len(res.replicas[0].partitions) != 1:
                return None
            return res.replicas[0].partitions[0].device

        if w.replicas > 1:
            # Replicas keep off each other's power domains, so a domain this replica takes is one
            # the others can no longer repair into: a device in a domain the chain already uses
            # (the lost one's included) comes first, a new domain only when none of those fits.
            lost = fleet.get(a.device)
            own = {d.power_domain for d in (fleet.get(x) for x in same_chain) if d is not None}
            if lost is not None:
                own.add(lost.power_domain)
            frugal = [d if d.power_domain in own or d.id in (src, snk) else replace(d, alive=False)
                      for d in devices]
            found = place(frugal)
            if found is not None:
                return found
        return place(devices)

    def _plan(self, fleet: Fleet, now: float) -> list[Command]:
        self._need_plan = False
        self._last_plan = now
        if not self.workloads:
            return []
        self.counters["plans"] += 1
        specs = self._plan_specs()
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
            sw = self.switches.get(res.name)
            rolling = sw is not None and sw.mode == ROLLING
            if res.placed:
                entry.replicas = res.replicas
                # rolling: the replicas placed so far, on the indices they hold
                indices = sorted({a.replica for a in self._mine(res.name, entry)}) if rolling else None
                out.extend(self._apply(entry, res.replicas, now, lost_at, indices))
            elif res.name in plan.evicted or not self._serving(res.name):
                entry.replicas = ()
                out.extend(self._drop_assignments(res.name))
            # else: it serves but could not be planned now (e.g. its source is away): keep it running
            if not res.placed and sw is not None and res.name not in plan.evicted:
                self._switch_unplaced(entry, sw, entry.reasons, fleet, now)
        return out

    def _plan_specs(self, full: str = "") -> list[Workload]:
        """The specs to plan: a rolling switch asks for the replicas it placed so far (none: skipped).

        ``full`` names a workload planned with its whole spec whatever its switch does.
        """
        specs = []
        for name, e in self.workloads.items():
            sw = self.switches.get(name)
            if sw is not None and sw.mode == ROLLING and name != full:
                n = len({a.replica for a in self._mine(name, e)})
                if n == 0:
                    continue  # its replicas are placed one at a time (``_roll``)
                if n < e.spec.replicas:
                    specs.append(replace(e.spec, replicas=n))
                    continue
            specs.append(e.spec)
        return specs

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
               lost_at: float, indices: Sequence[int] | None = None) -> list[Command]:
        """Make the assignments those of ``replicas`` (on replica ``indices``, default 0..n-1)."""
        name, version = entry.spec.name, entry.version
        out: list[Command] = []
        want: dict[PartKey, PartitionPlacement] = {}
        for r, rep in enumerate(replicas):
            for i, p in enumerate(rep.partitions):
                want[(name, version, indices[r] if indices else r, i)] = p
        changed = False
        for key in [k for k in self.assignments if k[0] == name and k not in want]:
            gone = self.assignments.pop(key)
            changed = True
            if gone.phase is not Phase.LOST:
                out.append(self._undeploy(gone.device, key))
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
                a.reason = f"no ack from {a.device} within {a.ack_window_s:.3g} s"
                self._by_command.pop(a.command_id, None)
                self._retry_or_move(a, now)

    def _ack_window(self, a: Assignment, fleet: Fleet) -> float:
        """Seconds a deploy of ``a`` may take to be acked: ``ack_timeout_s`` plus
        ``transfer_safety`` times its artifact's transfer (the partition's param bytes) over
        the device's downlink. A fixed window resends a large partition to a slow device before
        it can arrive (each resend queues the artifact again on the same link) until the device
        is given up and the workload re-planned."""
        entry, device = self.workloads.get(a.workload), fleet.get(a.device)
        prof = entry.spec.profile if entry is not None else None
        if prof is None or device is None or self.config.transfer_safety <= 0:
            return self.config.ack_timeout_s
        size = sum(s.param_bytes for s in prof.segments[a.first:a.last + 1])
        return self.config.ack_timeout_s + self.config.transfer_safety * 8 * size / device.downlink_bps

    def _send_due(self, fleet: Fleet, now: float) -> list[Command]:
        out: list[Command] = []
        for a in sorted(self.assignments.values(), key=lambda a: a.key):
            if a.phase is Phase.PENDING and now >= a.next_try:
                a.phase = Phase.DEPLOYING
                a.command_id = self._cmd_id()
                a.ack_window_s = self._ack_window(a, fleet)
                a.deadline = now + a.ack_window_s
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
            if healthy >= min(entry.spec.replicas, self.wanted_replicas(name)):
                entry.status = "running"
            elif healthy > 0:
                entry.status = "degraded"
            else:
                entry.status = "deploying"

    # ------------------------------------------------------------ version switches

    def _begin_switch(self, old: WorkloadEntry) -> list[Command]:
        """``old`` is replaced by a new version: keep what serves, undeploy what cannot serve.

        The version that serves on is the switch's old one if it still has a live replica (a
        third version arriving before the second runs), else ``old``'s. Partitions of the
        other version that served (rolling) retire with a drain; the rest goes at once.
        """
        name = old.spec.name
        out: list[Command] = []
        cur = sorted((a for k, a in self.assignments.items() if k[0] == name), key=lambda a: a.key)
        for a in cur:
            del self.assignments[a.key]
            self._first_sent.pop(a.key, None)
        nseg = len(old.spec.profile.segments) if old.spec.profile is not None else 0
        sw = self.switches.get(name)
        if sw is not None and self._live_old(sw):
            served = {r for r, _ in self._chains_of(name, old, cur)} if sw.mode == ROLLING else set()
            for a in cur:
                if a.replica in served:
                    sw.parts[a.key] = a
                    sw.retire_at[a.key] = math.nan
                else:
                    out.extend(self._undeploy_old(sw, a, math.nan))
        else:
            if sw is None:
                sw = Switch(old.version, nseg, old.spec)
            else:  # what is left of the older version serves no more
                for key in [k for k in sw.parts if k not in sw.retire_at]:
                    out.extend(self._undeploy_old(sw, sw.parts.pop(key), math.nan))
                sw.version, sw.segments, sw.spec = old.version, nseg, old.spec
            live = {r for r, parts in _by_replica(cur).items() if _complete(parts, nseg)
                    and all(a.phase in (Phase.RUNNING, Phase.UNCONFIRMED) for a in parts)}
            for a in cur:
                if a.replica in live:
                    sw.parts[a.key] = a
                else:
                    out.extend(self._undeploy_old(sw, a, math.nan))
        sw.specs[old.version] = old.spec
        sw.mode, sw.since, sw.reason, sw.next_try = MAKE_BEFORE_BREAK, math.nan, "", -math.inf
        if sw.parts or sw.gone:
            self.switches[name] = sw
            self.counters["switches"] += 1
        else:
            self.switches.pop(name, None)
        out.append(Persist(name))
        return out

    def _adopt_switch(self, parts: Sequence[Assignment]) -> Switch:
        """A switch rebuilt from stored old partitions (a restart): the version with the most
        complete replicas serves (the newest on a tie); the other versions' retire."""
        versions: dict[int, list[Assignment]] = {}
        for a in parts:
            versions.setdefault(a.key[1], []).append(a)
        segs = {v: max(a.last for a in ps) + 1 for v, ps in versions.items()}
        score = {v: sum(1 for rp in _by_replica(ps).values() if _complete(rp, segs[v])) for v, ps in versions.items()}
        v = max(versions, key=lambda v: (score[v], v))
        sw = Switch(v, segs[v], None)
        for a in parts:
            sw.parts[a.key] = a
            if a.key[1] != v:
                sw.retire_at[a.key] = math.nan
        return sw

    def _undeploy_old(self, sw: Switch, a: Assignment, now: float) -> list[Command]:
        """Undeploy an old partition now (nothing if it is lost) and remember it until it is gone."""
        if a.phase is Phase.LOST:
            return []
        sw.gone[a.key] = (a, now)
        return [self._undeploy(a.device, a.key)]

    def _live_old(self, sw: Switch) -> dict[int, list[Assignment]]:
        """The switch's old replicas that serve or will once reported: complete, none lost, not retired."""
        mine = [a for k, a in sw.parts.items() if k[1] == sw.version and k not in sw.retire_at]
        return {r: parts for r, parts in _by_replica(mine).items() if _complete(parts, sw.segments)
                and all(a.phase in (Phase.RUNNING, Phase.UNCONFIRMED) for a in parts)}

    def _retire(self, sw: Switch, parts: Iterable[Assignment], now: float) -> None:
        for a in parts:
            sw.retire_at[a.key] = now + self.config.drain_s

    def _advance_switches(self, fleet: Fleet, now: float) -> list[Command]:
        """Each switch one step on: drop broken old replicas, cut over, roll, undeploy what drained."""
        out: list[Command] = []
        for name in list(self.switches):
            sw = self.switches[name]
            entry = self.workloads[name]
            before = (len(sw.parts), len(sw.retire_at))
            if math.isnan(sw.since):
                sw.since = now
            for k, t in sw.retire_at.items():
                if math.isnan(t):
                    sw.retire_at[k] = now + self.config.drain_s
            for k, (a, t) in sw.gone.items():
                if math.isnan(t):
                    sw.gone[k] = (a, now)
            # An old replica with a lost partition never serves again (old versions are not
            # repaired): its other partitions go now. Retired partitions that were lost: forget.
            for k in [k for k, a in sw.parts.items() if k in sw.retire_at and a.phase is Phase.LOST]:
                del sw.parts[k], sw.retire_at[k]
            live = self._live_old(sw)
            for k in [k for k, a in sw.parts.items() if k not in sw.retire_at and a.replica not in live]:
                out.extend(self._undeploy_old(sw, sw.parts.pop(k), now))
            mine = self._mine(name, entry)
            healthy = self._chains_of(name, entry, mine)
            if len(healthy) >= entry.spec.replicas:
                # Made: every replica of the new version runs. The old one breaks (drained).
                for parts in live.values():
                    self._retire(sw, parts, now)
                sw.reason = ""
            elif sw.mode == ROLLING and now >= sw.next_try:
                out.extend(self._roll(sw, entry, mine, bool(healthy), live, fleet, now))
            for k, t in list(sw.retire_at.items()):
                if t <= now:  # drained: requests routed before it retired had their time
                    del sw.retire_at[k]
                    self.counters["retired"] += 1
                    out.extend(self._undeploy_old(sw, sw.parts.pop(k), now))
            placed = len({a.replica for a in mine})
            if not sw.parts and not sw.gone and (sw.mode != ROLLING or placed >= entry.spec.replicas):
                del self.switches[name]
                entry.reasons.pop("switch", None)
                out.append(Persist(name))
                continue
            if sw.reason:
                entry.reasons["switch"] = sw.reason
            else:
                entry.reasons.pop("switch", None)
            if (len(sw.parts), len(sw.retire_at)) != before:
                out.append(Persist(name))
        return out

    def _switch_unplaced(self, entry: WorkloadEntry, sw: Switch, reasons: Mapping[str, str], fleet: Fleet,
                         now: float) -> None:
        """The new version did not fit next to the old one: roll if that can help, else say why not."""
        if sw.mode != MAKE_BEFORE_BREAK or not self._live_old(sw):
            return  # already falling back, or nothing old serves (nothing to protect: plain re-plans)
        new, old = entry.version, sw.version
        fits = self._fits_without_old(entry, sw, fleet)
        if fits is False or (fits is None and not ({"fit", "anti-affinity"} & set(reasons))):
            sw.reason = f"v{new} cannot be placed, not even without v{old}: v{old} keeps serving"
            return
        sw.mode, sw.next_try = ROLLING, -math.inf
        sw.reason = f"v{new} does not fit next to v{old}: switching replica by replica"
        if not sw.fell_back:
            sw.fell_back = True
            self.counters["switches_rolling"] += 1

    def _roll(self, sw: Switch, entry: WorkloadEntry, mine: Sequence[Assignment], new_serves: bool,
              live: Mapping[int, Sequence[Assignment]], fleet: Fleet, now: float) -> list[Command]:
        """One rolling step: place a new replica, or retire an old one, never the last that serves."""
        if any(a.phase is not Phase.RUNNING for a in mine) or sw.retire_at or sw.gone:
            return []  # a step in progress: a new replica deploying, or old memory being freed
        new, old, n = entry.version, sw.version, entry.spec.replicas
        placed = {a.replica for a in mine}
        # An index no old replica holds first; one an old replica holds is fine too (fewer new
        # replicas than old ones): once the new chain runs, ``chains`` drops the old one of that index.
        free = sorted((r for r in range(n) if r not in placed), key=lambda r: (r in live, r))
        if free:
            cmds, _ = self._place_replica(entry, free[0], fleet, now)
            if cmds:
                sw.reason = f"v{new} does not fit next to v{old}: v{new} replica {free[0]} deploying"
                return cmds
        if len(live) >= 2 or (live and new_serves):
            r = max(live)
            self._retire(sw, live[r], now)
            sw.reason = f"v{new} does not fit next to v{old}: v{old} replica {r} retired to make room"
            return []
        if live:
            return self._break(sw, entry, live, fleet, now)
        sw.reason = f"v{new} replica {free[0] if free else '?'} waits for room (v{old} is gone)"
        sw.next_try = now + self.config.replan_interval_s
        return []

    def _break(self, sw: Switch, entry: WorkloadEntry, live: Mapping[int, Sequence[Assignment]], fleet: Fleet,
               now: float) -> list[Command]:
        """The last old replica and no room for a new one next to it: break before making, if that helps."""
        new, old = entry.version, sw.version
        wait = self.config.switch_break_after_s
        sw.next_try = now + self.config.replan_interval_s
        fits = self._fits_without_old(entry, sw, fleet)
        if fits is not True or math.isinf(wait):
            why = ("break-before-make is off" if math.isinf(wait) and fits else
                   f"not even without v{old}" if fits is False else
                   f"unknown whether it fits without v{old} (adopted after a restart)")
            sw.reason = f"v{new} does not fit next to v{old} ({why}): v{old} keeps serving"
            # Back to plain make-before-break: the re-plans of a pending workload try again, and
            # room that appears (a device joins, another workload goes) is taken at once.
            sw.mode = MAKE_BEFORE_BREAK
            return []
        if now - sw.since < wait:
            sw.reason = (f"v{new} does not fit next to v{old}: break-before-make in "
                         f"{sw.since + wait - now:.1f} s")
            sw.next_try = min(sw.next_try, sw.since + wait)
            return []
        sw.mode = BREAK_BEFORE_MAKE
        self.counters["switches_broken"] += 1
        # No drain here: v1 serves up to its undeploy (this pass) and only the requests in flight
        # then fail, where a drain would refuse every request of the drain on top.
        for parts in live.values():
            for a in parts:
                sw.retire_at[a.key] = now
        sw.reason = (f"break-before-make: v{new} does not fit next to v{old}, not even one replica; "
                     f"v{old} is undeployed, requests are refused until v{new} runs")
        return []

    def _fits_without_old(self, entry: WorkloadEntry, sw: Switch, fleet: Fleet) -> bool | None:
        """Whether the whole new version would be placed with the old version's memory free (None: unknown)."""
        if sw.spec is None or sw.spec.profile is None:
            return None
        extra: dict[str, float] = {}
        held = list(sw.parts.values()) + [a for a, _ in sw.gone.values()]
        for a in held:  # every old version's memory (a third version: the second's draining too)
            old = sw.specs.get(a.key[1])
            if old is not None and old.profile is not None and a.phase is not Phase.LOST:
                extra[a.device] = extra.get(a.device, 0.0) + old.profile.memory_of(a.first, a.last)
        devices = tuple(replace(d, memory_bytes=d.memory_bytes + extra[d.id]) if d.id in extra else d
                        for d in fleet.devices)
        name = entry.spec.name
        plan = self.schedule(Fleet(devices), self._plan_specs(full=name), current=self._current(),
                             quotas=self.quotas or None)
        return any(r.name == name and r.placed for r in plan.workloads)

    # ------------------------------------------------------------ scaling (``scale``)

    def _scale(self, fleet: Fleet, now: float) -> list[Command]:
        """One step of each workload's scaling: drop drained chains, add one missing chain."""
        out: list[Command] = []
        for name, entry in self.workloads.items():
            if name in self.switches:
                continue
            want = entry.want
            if entry.draining:
                due = [r for r, t in entry.draining.items() if t <= now]
                if due and len(due) == len(entry.draining) and want is not None:
                    out.extend(self._drop_replicas(entry, min(due)))
                    entry.draining.clear()
                    entry.spec = replace(entry.spec, replicas=want)
                    entry.replicas = entry.replicas[:want]
            if want is None or want <= entry.spec.replicas or now < entry.scale_next_try:
                continue
            r = entry.spec.replicas
            have = {a.replica for a in self._mine(name, entry)}
            if have != set(range(r)):
                entry.scale_next_try = now + self.config.replan_interval_s
                continue  # a chain is being (re)placed: add one once the gang is whole
            cmds, why = self._add_replica(entry, r, fleet, now)
            if cmds:
                entry.spec = replace(entry.spec, replicas=r + 1)
                entry.scale_reason = ""
                self.counters["scaled_up"] = self.counters.get("scaled_up", 0) + 1
                out.extend(cmds)
                entry.scale_next_try = now
            else:
                entry.scale_reason = f"replica {r} does not fit: {why}"
                entry.scale_next_try = now + self.config.replan_interval_s
        return out

    def _drop_replicas(self, entry: WorkloadEntry, first: int) -> list[Command]:
        """Undeploy replicas ``first`` and up of the workload's version (drained: nothing routed there)."""
        name = entry.spec.name
        out: list[Command] = []
        for key in sorted(k for k in self.assignments if k[0] == name and k[1] == entry.version and k[2] >= first):
            a = self.assignments.pop(key)
            self._first_sent.pop(key, None)
            self._missing_since.pop(key, None)
            if a.phase is not Phase.LOST:
                out.append(self._undeploy(a.device, key))
        self.counters["scaled_down"] = self.counters.get("scaled_down", 0) + 1
        out.append(Persist(name))
        return out

    def _add_replica(self, entry: WorkloadEntry, r: int, fleet: Fleet, now: float) -> tuple[list[Command], str]:
        """Place replica ``r`` alone beside the running ones, within the tenant's quota left."""
        w = entry.spec
        quotas = None
        q = self.quotas.get(w.tenant)
        if q is not None:
            used = 0.0
            for a in self._all_parts():
                e = self.workloads.get(a.workload)
                if a.phase is Phase.LOST or e is None or e.spec.tenant != w.tenant or e.spec.profile is None:
                    continue
                used += e.spec.profile.memory_of(a.first, a.last)
            quotas = {w.tenant: Quota(max(0.0, q.memory_bytes - used))}
        return self._place_replica(entry, r, fleet, now, spread=True, quotas=quotas)

    def _place_replica(self, entry: WorkloadEntry, r: int, fleet: Fleet, now: float, *, spread: bool = False,
                       quotas: Mapping[str, Quota] | None = None) -> tuple[list[Command], str]:
        """Place replica ``r`` of the workload's version alone, beside its replicas placed so far
        (rolling switches and scaling); the commands, or why it does not fit."""
        w = entry.spec
        if w.profile is None or w.source not in fleet.index or w.sink not in fleet.index:
            return [], "its source or sink is not in the fleet"
        domains = set()
        if w.replicas > 1 or spread:
            for a in self._mine(w.name, entry):
                d = fleet.get(a.device)
                if d is not None and a.replica != r and a.phase is not Phase.LOST:
                    domains.add(d.power_domain)
        used = self._used(fleet)
        devices = []
        for d in fleet.devices:
            u = used.get(d.id, 0.0)
            banned = d.power_domain in domains
            if u == 0.0 and not banned:
                devices.append(d)
                continue
            devices.append(replace(d, memory_bytes=max(0.0, d.memory_bytes - u), alive=d.alive and not banned))
        plan = self.schedule(Fleet(tuple(devices)), [replace(w, name=f"{w.name}#replica-{r}", replicas=1)],
                             current=None, quotas=quotas)
        res = plan.workloads[0]
        if not res.placed:
            return [], "; ".join(f"{k}: {v}" for k, v in res.reasons) or "no fit"
        for i, p in enumerate(res.replicas[0].partitions):
            key = (w.name, entry.version, r, i)
            self.assignments[key] = Assignment(key, p.device, p.first, p.last, next_try=now)
            self._first_sent.pop(key, None)
        if spread:  # scaling: the new chain's predicted costs for status
            entry.replicas = entry.replicas[:r] + res.replicas + entry.replicas[r + 1:]
        return [Persist(w.name)], ""
