"""The deployment controller: desired placements against reported partitions.

Pure: the scheduler is an injected function, time is a parameter, and every
effect is a returned command (deploy, undeploy, persist). One owner thread
drives it.

``Controller`` holds the book (``controller.model``: workloads, assignments, switches) and the
loop: ``reconcile`` observes reports (``controller.observe``), repairs what was lost keeping the
cut points (``controller.repair``), scales (``controller.scaling``), plans what is pending,
advances version switches (``controller.switch``, a transition table) and applies: assignments
become deploy and undeploy commands (``controller.apply``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from runtime.messages import Hop, PartitionStatus

from ..placement.model import ChainProfile, Fleet, Quota, Workload
from ..placement.plan import PartitionPlacement, ReplicaPlacement, WorkloadPlacement
from .apply import Applier
from .model import (
    LOST_REASON,
    NOT_ALIVE_REASON,
    NOT_REPORTED_REASON,
    ROLLING,
    Assignment,
    Command,
    ControllerConfig,
    PartKey,
    Phase,
    ScheduleFn,
    Switch,
    UndeployPartition,
    WorkloadEntry,
    serving_chains,
)
from .observe import Observer
from .repair import Repairer
from .scaling import Scaler
from .switch import Switcher

__all__ = ["Controller"]


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
                                          "switches_broken": 0, "retired": 0, "evicted_memory": 0}
        self._seq = 0
        self._need_plan = True
        self._last_plan = -math.inf
        self._pending_undeploy: list[UndeployPartition] = []
        self._orphans_seen: dict[tuple[str, PartKey], float] = {}
        self._missing_since: dict[PartKey, float] = {}
        self._first_sent: dict[PartKey, float] = {}
        self._by_command: dict[str, PartKey] = {}
        self._fallback_lost_at = math.nan
        # the stages, each in its own module; they read and write this object's book
        self.observer = Observer(self)
        self.repairer = Repairer(self)
        self.applier = Applier(self)
        self.switcher = Switcher(self)
        self.scaler = Scaler(self)

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
            self.switches[name] = self.switcher.adopt(parts)
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
            out.extend(self.switcher.begin(old))
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
        with its gates, at the next passes; the running chains stay where they are. Down: the
        highest replicas stop taking requests at once and are undeployed ``drain_s`` later
        (``controller.scaling``). Returns False when ``name`` is unknown or switching versions.
        """
        return self.scaler.scale(name, replicas, now)

    def wanted_replicas(self, name: str) -> int:
        """The replica chains ``name`` wants now (its autoscaler's count, else its spec's)."""
        return self.scaler.wanted(name)

    def update_costs(self, name: str, profile: ChainProfile) -> None:
        """Measured costs for a workload's chain: used from the next plan on (a device lost, new work),
        without planning now: nothing that runs moves because a timing came in."""
        entry = self.workloads.get(name)
        if entry is not None and entry.spec.profile is not None:
            entry.spec = replace(entry.spec, profile=profile)

    def remove_workload(self, name: str) -> list[Command]:
        """Delete a workload: every partition of every version goes now (a switch ends with it)."""
        out = self.applier.drop_workload(name)
        sw = self.switches.pop(name, None)
        if sw is not None:
            out.extend(self.applier.undeploy(a.device, a.key) for a in sw.parts.values() if a.phase is not Phase.LOST)
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

    def device_joined(self, device_id: str, memory_bytes: float | None = None, now: float = 0.0) -> bool:
        """A device (re)joined; ``memory_bytes``: what its birth declares. A birth that declares
        less than the partitions it is assigned need (a smaller board under the same id, a hostile
        rebirth) loses the ones past it, last key first: they are re-placed, never left to fail.
        True when it lost any."""
        self._need_plan = any(e.status == "pending" for e in self.workloads.values()) or self._need_plan
        if memory_bytes is None:
            return False
        held = sorted((a for a in self.assignments.values() if a.device == device_id and a.phase is not Phase.LOST),
                      key=lambda a: a.key)
        sizes = {a.key: self._memory_of(a) for a in held}
        total, lost = sum(sizes.values()), False
        while held and total > memory_bytes + 1e-6:
            a = held.pop()
            total -= sizes[a.key]
            a.phase, a.lost_at = Phase.LOST, now
            a.reason = f"does not fit {device_id}'s memory ({int(memory_bytes)} bytes declared at its birth)"
            self.counters["evicted_memory"] += 1
            lost = True
        return lost

    def _memory_of(self, a: Assignment) -> float:
        entry = self.workloads.get(a.key[0])
        if entry is None or entry.spec.profile is None:
            return 0.0
        return float(entry.spec.profile.memory_of(a.first, a.last))

    def device_lost(self, device_id: str, now: float) -> None:
        for a in self.all_parts():
            if a.device == device_id and a.phase is not Phase.LOST:
                a.phase = Phase.LOST
                a.lost_at = now
                a.reason = LOST_REASON

    def ack(self, command_id: str, device_id: str, ok: bool, reason: str, now: float) -> list[Command]:
        key = self._by_command.pop(command_id, None)
        a = self.assignments.get(key) if key is not None else None
        if a is None or a.command_id != command_id or a.device != device_id:
            return []  # an ack of an undeploy, of a superseded attempt, or of a forged id
        if ok:
            self.applier.mark_running(a, now)
            self._update_status()
            return []
        self.counters["nacks"] += 1
        a.reason = f"NACK from {device_id}: {reason}"
        return self.applier.retry_or_move(a, now)

    def note_sha(self, key: PartKey, sha256: str) -> None:
        a = self.assignments.get(key)
        if a is not None:
            a.sha256 = sha256

    def reconcile(self, fleet: Fleet, reported: Mapping[str, Sequence[PartitionStatus]],
                  now: float) -> list[Command]:
        """One pass: observe reports, repair losses, (re)plan, send due deploys."""
        out: list[Command] = []
        out.extend(self.observer.observe(fleet, reported, now))
        if not self.ready:
            if now < self.ready_at and not self.observer.all_heard(fleet, reported):
                return out
            self.ready = True
            for a in self.assignments.values():
                if a.phase is Phase.UNCONFIRMED:
                    dev = fleet.get(a.device)
                    a.phase = Phase.PENDING if dev is not None and dev.alive else Phase.LOST
                    a.lost_at = now
                    a.reason = NOT_REPORTED_REASON
            for sw in self.switches.values():
                for a in sw.parts.values():
                    if a.phase is Phase.UNCONFIRMED:  # an old version is never redeployed
                        a.phase, a.lost_at, a.reason = Phase.LOST, now, NOT_REPORTED_REASON
            self._need_plan = True
        alive = fleet.cache.get("alive_ids")
        if alive is None:  # derived from the immutable snapshot: computed once per snapshot
            alive = fleet.cache["alive_ids"] = frozenset(d.id for d in fleet.devices if d.alive)
        for a in self.assignments.values():
            if a.phase is not Phase.LOST and a.device not in alive:
                a.phase, a.lost_at, a.reason = Phase.LOST, now, NOT_ALIVE_REASON
        for sw in self.switches.values():
            for a in sw.parts.values():
                if a.phase is not Phase.LOST and a.device not in alive:
                    a.phase, a.lost_at, a.reason = Phase.LOST, now, NOT_ALIVE_REASON
        self.applier.expire(now)
        out.extend(self.repairer.repair(fleet, now))
        out.extend(self.scaler.step(fleet, now))
        if self._need_plan or (now - self._last_plan >= self.config.replan_interval_s
                               and any(e.status == "pending" for e in self.workloads.values())):
            out.extend(self._plan(fleet, now))
        if self.switches:
            out.extend(self.switcher.advance(fleet, now))
        out.extend(self.applier.send_due(fleet, now))
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

    def chains(self, workload: str) -> list[tuple[int, tuple[Hop, ...]]]:
        """The chains that serve requests now (every partition RUNNING), primary first.

        The workload's own version's healthy chains, lowest replica first; during a switch
        the old version's until the new one runs (rolling: the new one's, then the old ones'
        left, on other replica indices); when no old chain is left, the new one's.
        """
        entry = self.workloads.get(workload)
        if entry is None:
            return []
        new = self.chains_of(workload, entry, self.mine_of(workload, entry))
        if entry.draining:
            new = [c for c in new if c[0] not in entry.draining]
        sw = self.switches.get(workload)
        if sw is None:
            return new
        old = self.switcher.old_chains(workload, sw)
        if sw.mode == ROLLING:
            taken = {r for r, _ in new}
            return new + [c for c in old if c[0] not in taken]
        return old or new

    def healthy_replicas(self, workload: str) -> int:
        """Healthy chains of the workload's own (newest) version, whatever serves during a switch."""
        entry = self.workloads.get(workload)
        return 0 if entry is None else len(self.chains_of(workload, entry, self.mine_of(workload, entry)))

    def switch_view(self, workload: str) -> dict[str, object] | None:
        """The switch in progress of ``workload`` for ``fogline status`` (None: none)."""
        return self.switcher.view(workload)

    def persisted_of(self, workload: str) -> list[Assignment]:
        """What the store keeps for ``workload``: its assignments and the old ones of a switch."""
        out = self.assignments_of(workload)
        sw = self.switches.get(workload)
        if sw is not None:
            out.extend(sorted(sw.parts.values(), key=lambda a: a.key))
        return out

    def mine_of(self, workload: str, entry: WorkloadEntry) -> list[Assignment]:
        return [a for a in self.assignments.values() if a.key[0] == workload and a.key[1] == entry.version]

    def all_parts(self) -> Iterable[Assignment]:
        """Every assignment: current versions' and the old ones of switches."""
        yield from self.assignments.values()
        for sw in self.switches.values():
            yield from sw.parts.values()

    def chains_of(self, workload: str, entry: WorkloadEntry,
                   mine: Sequence[Assignment]) -> list[tuple[int, tuple[Hop, ...]]]:
        """``chains`` over ``mine``: the workload's assignments of its version, in dict order."""
        nseg = len(entry.spec.profile.segments) if entry.spec.profile is not None else -1
        return serving_chains(workload, entry.version, nseg, mine)

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

    def current(self) -> dict[str, WorkloadPlacement]:
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

    def _plan(self, fleet: Fleet, now: float) -> list[Command]:
        self._need_plan = False
        self._last_plan = now
        if not self.workloads:
            return []
        self.counters["plans"] += 1
        specs = self.plan_specs()
        plan = self.schedule(fleet, specs, current=self.current(), quotas=self.quotas or None)
        self.metrics = {"utilization": plan.metrics.utilization, "fragmentation": plan.metrics.fragmentation}
        for name in plan.evicted:
            self.evicted[name] = now
        out: list[Command] = []
        lost_at = self._fallback_lost_at
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
                indices = sorted({a.replica for a in self.mine_of(res.name, entry)}) if rolling else None
                out.extend(self.applier.apply(entry, res.replicas, now, lost_at, indices))
            elif res.name in plan.evicted or not self.chains(res.name):
                entry.replicas = ()
                out.extend(self.applier.drop_assignments(res.name))
            # else: it serves but could not be planned now (e.g. its source is away): keep it running
            if not res.placed and sw is not None and res.name not in plan.evicted:
                self.switcher.unplaced(entry, sw, entry.reasons, fleet, now)
        return out

    def plan_specs(self, full: str = "") -> list[Workload]:
        """The specs to plan: a rolling switch asks for the replicas it placed so far (none: skipped).

        ``full`` names a workload planned with its whole spec whatever its switch does.
        """
        specs = []
        for name, e in self.workloads.items():
            sw = self.switches.get(name)
            if sw is not None and sw.mode == ROLLING and name != full:
                n = len({a.replica for a in self.mine_of(name, e)})
                if n == 0:
                    continue  # its replicas are placed one at a time (``Switcher.roll``)
                if n < e.spec.replicas:
                    specs.append(replace(e.spec, replicas=n))
                    continue
            specs.append(e.spec)
        return specs


    def _update_status(self) -> None:
        groups = self._by_workload()
        for name, entry in self.workloads.items():
            parts = groups.get(name)
            if not parts:
                entry.status = "pending"
                continue
            healthy = len(self.chains_of(name, entry, parts))
            if healthy >= min(entry.spec.replicas, self.wanted_replicas(name)):
                entry.status = "running"
            elif healthy > 0:
                entry.status = "degraded"
            else:
                entry.status = "deploying"
