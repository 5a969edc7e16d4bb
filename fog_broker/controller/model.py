"""The controller's model: assignments and their phases, switches, commands, configuration.

Lifecycle of one partition assignment (``Phase``)::

    PENDING --deploy sent--> DEPLOYING --ack ok / reported running--> RUNNING
    DEPLOYING --no ack by the deadline / NACK--> PENDING (backoff) ... --too many--> repair elsewhere
    UNCONFIRMED (loaded after a restart) --reported running--> RUNNING
    any --device lost--> LOST --repair--> a new PENDING assignment (same segments, other device)

Commands and the configuration are frozen messages. ``Assignment``, ``WorkloadEntry`` and
``Switch`` are the controller's own book, mutated in place by its one owner thread (a reconcile
pass touches thousands of them: copying each on every phase change would cost the pass).
"""
from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from runtime.messages import Hop

from ..placement.model import ChainProfile, Workload
from ..placement.plan import Plan, ReplicaPlacement

__all__ = [
    "Phase", "PartKey", "Assignment", "WorkloadEntry", "ControllerConfig",
    "DeployPartition", "UndeployPartition", "Persist", "Command", "ScheduleFn", "sub_profile",
    "Switch", "MAKE_BEFORE_BREAK", "ROLLING", "BREAK_BEFORE_MAKE", "AWAIT_BUILD", "SWITCH_REASON",
    "LOST_REASON", "NOT_ALIVE_REASON", "NOT_REPORTED_REASON", "DIED_REASONS",
    "complete", "by_replica", "serving_chains",
]

# Why a partition was lost when its device died (not when the partition failed there): the
# device may take it back once it has rejoined.
LOST_REASON, NOT_ALIVE_REASON = "device lost", "device not alive"
NOT_REPORTED_REASON = "not reported after restart"
DIED_REASONS = frozenset((LOST_REASON, NOT_ALIVE_REASON, NOT_REPORTED_REASON))

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
    ack_window_s: float = 0.0  # the current attempt's ack window (``Applier.ack_window``)
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


#: Switch modes (``Switch.mode``); ``controller.switch.TRANSITIONS`` says which step leads where.
MAKE_BEFORE_BREAK = "make-before-break"
ROLLING = "rolling"
BREAK_BEFORE_MAKE = "break-before-make"
#: The key of a workload's pending reasons that says why its switch waits (next to the gates).
SWITCH_REASON = "switch"


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


def complete(parts: Sequence[Assignment], nseg: int) -> bool:
    """``parts`` (sorted by index) cover segments 0..nseg-1 contiguously."""
    return bool(parts) and parts[0].first == 0 and parts[-1].last == nseg - 1 and \
        all(p.first == q.last + 1 for q, p in itertools.pairwise(parts))


def by_replica(parts: Iterable[Assignment]) -> dict[int, list[Assignment]]:
    """Assignments grouped by replica, each group sorted by index; replicas in ascending order."""
    by_rep: dict[int, list[Assignment]] = {}
    for a in parts:
        by_rep.setdefault(a.replica, []).append(a)
    return {r: sorted(by_rep[r], key=lambda a: a.index) for r in sorted(by_rep)}


def serving_chains(workload: str, version: int, nseg: int,
                   mine: Iterable[Assignment]) -> list[tuple[int, tuple[Hop, ...]]]:
    """The complete chains of ``mine`` (one version's assignments) whose partitions all run."""
    out = []
    for r, parts in by_replica(mine).items():
        if any(a.phase is not Phase.RUNNING for a in parts):
            continue
        if not complete(parts, nseg):
            continue  # a chain in the middle of a re-plan: not complete
        out.append((r, tuple(Hop(a.device, workload, version, r, a.index) for a in parts)))
    return out
