"""Scaling a workload without a new version (issue 33): replica chains added or drained.

Up: each missing chain is placed alone beside the running ones, through the scheduler with its
gates (memory, power domains apart from the other replicas, the tenant's quota left); the running
chains stay where they are. Down: the highest replicas stop taking requests at once and are
undeployed ``drain_s`` later. ``place_replica`` is also the rolling switch's one step.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from ..placement.model import Fleet, Quota
from .model import Assignment, Command, Persist, Phase, WorkloadEntry

if TYPE_CHECKING:
    from ._core import Controller

__all__ = ["Scaler"]


class Scaler:
    """The replica count of each workload of the controller ``c``."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def scale(self, name: str, replicas: int, now: float) -> bool:
        """``Controller.scale``: want ``replicas`` chains of ``name`` (False: unknown or switching)."""
        c = self.c
        entry = c.workloads.get(name)
        if entry is None or name in c.switches or replicas < 1:
            return False
        cur = entry.spec.replicas
        entry.want = replicas
        entry.scale_reason = ""
        entry.scale_next_try = now
        # a replica drained but wanted again serves again at once (it never left)
        for r in [r for r in entry.draining if r < replicas]:
            del entry.draining[r]
        for r in range(replicas, cur):
            entry.draining.setdefault(r, now + c.config.drain_s)
        return True

    def wanted(self, name: str) -> int:
        """The replica chains ``name`` wants now (its autoscaler's count, else its spec's)."""
        entry = self.c.workloads.get(name)
        if entry is None:
            return 0
        return entry.spec.replicas if entry.want is None else entry.want

    def step(self, fleet: Fleet, now: float) -> list[Command]:
        """One step of each workload's scaling: drop drained chains, add one missing chain."""
        c = self.c
        out: list[Command] = []
        for name, entry in c.workloads.items():
            if name in c.switches:
                continue
            want = entry.want
            if entry.draining:
                due = [r for r, t in entry.draining.items() if t <= now]
                if due and len(due) == len(entry.draining) and want is not None:
                    out.extend(self.drop_replicas(entry, min(due)))
                    entry.draining.clear()
                    entry.spec = replace(entry.spec, replicas=want)
                    entry.replicas = entry.replicas[:want]
            if want is None or want <= entry.spec.replicas or now < entry.scale_next_try:
                continue
            r = entry.spec.replicas
            have = {a.replica for a in c.mine_of(name, entry)}
            if have != set(range(r)):
                entry.scale_next_try = now + c.config.replan_interval_s
                continue  # a chain is being (re)placed: add one once the gang is whole
            cmds, why = self.add_replica(entry, r, fleet, now)
            if cmds:
                entry.spec = replace(entry.spec, replicas=r + 1)
                entry.scale_reason = ""
                c.counters["scaled_up"] = c.counters.get("scaled_up", 0) + 1
                out.extend(cmds)
                entry.scale_next_try = now
            else:
                entry.scale_reason = f"replica {r} does not fit: {why}"
                entry.scale_next_try = now + c.config.replan_interval_s
        return out

    def drop_replicas(self, entry: WorkloadEntry, first: int) -> list[Command]:
        """Undeploy replicas ``first`` and up of the workload's version (drained: nothing routed there)."""
        c = self.c
        name = entry.spec.name
        out: list[Command] = []
        for key in sorted(k for k in c.assignments if k[0] == name and k[1] == entry.version and k[2] >= first):
            a = c.assignments.pop(key)
            c._first_sent.pop(key, None)
            c._missing_since.pop(key, None)
            if a.phase is not Phase.LOST:
                out.append(c.applier.undeploy(a.device, key))
        c.counters["scaled_down"] = c.counters.get("scaled_down", 0) + 1
        out.append(Persist(name))
        return out

    def add_replica(self, entry: WorkloadEntry, r: int, fleet: Fleet, now: float) -> tuple[list[Command], str]:
        """Place replica ``r`` alone beside the running ones, within the tenant's quota left."""
        c = self.c
        w = entry.spec
        quotas = None
        q = c.quotas.get(w.tenant)
        if q is not None:
            used = 0.0
            for a in c.all_parts():
                e = c.workloads.get(a.workload)
                if a.phase is Phase.LOST or e is None or e.spec.tenant != w.tenant or e.spec.profile is None:
                    continue
                used += e.spec.profile.memory_of(a.first, a.last)
            quotas = {w.tenant: Quota(max(0.0, q.memory_bytes - used))}
        return self.place_replica(entry, r, fleet, now, spread=True, quotas=quotas)

    def place_replica(self, entry: WorkloadEntry, r: int, fleet: Fleet, now: float, *, spread: bool = False,
                       quotas: Mapping[str, Quota] | None = None) -> tuple[list[Command], str]:
        """Place replica ``r`` of the workload's version alone, beside its replicas placed so far
        (rolling switches and scaling); the commands, or why it does not fit."""
        c = self.c
        w = entry.spec
        if w.profile is None or w.source not in fleet.index or w.sink not in fleet.index:
            return [], "its source or sink is not in the fleet"
        domains = set()
        if w.replicas > 1 or spread:
            for a in c.mine_of(w.name, entry):
                d = fleet.get(a.device)
                if d is not None and a.replica != r and a.phase is not Phase.LOST:
                    domains.add(d.power_domain)
        used = c.repairer.used(fleet)
        devices = []
        for d in fleet.devices:
            u = used.get(d.id, 0.0)
            banned = d.power_domain in domains
            if u == 0.0 and not banned:
                devices.append(d)
                continue
            devices.append(replace(d, memory_bytes=int(max(0.0, d.memory_bytes - u)), alive=d.alive and not banned))
        plan = c.schedule(Fleet(tuple(devices)), [replace(w, name=f"{w.name}#replica-{r}", replicas=1)],
                             current=None, quotas=quotas)
        res = plan.workloads[0]
        if not res.placed:
            return [], "; ".join(f"{k}: {v}" for k, v in res.reasons) or "no fit"
        for i, p in enumerate(res.replicas[0].partitions):
            key = (w.name, entry.version, r, i)
            c.assignments[key] = Assignment(key, p.device, p.first, p.last, next_try=now)
            c._first_sent.pop(key, None)
        if spread:  # scaling: the new chain's predicted costs for status
            entry.replicas = entry.replicas[:r] + res.replicas + entry.replicas[r + 1:]
        return [Persist(w.name)], ""
