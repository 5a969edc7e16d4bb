"""The controller's repair stage: a lost partition is re-placed keeping its cut points.

A lost partition is placed as a one-partition sub-chain between its neighbours, so the healthy
partitions of the chain, its other replicas and every other workload stay where they are. When no
device can take it, the workload is re-planned whole (the scheduler may preempt), unless a healthy
replica still serves: that is never torn down for the broken one.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from ..placement.model import Device, Fleet, Workload
from .model import (
    DIED_REASONS,
    Assignment,
    Command,
    PartKey,
    Persist,
    Phase,
    WorkloadEntry,
    sub_profile,
)

if TYPE_CHECKING:
    from ._core import Controller

__all__ = ["Repairer"]


class Repairer:
    """Repairs the lost partitions of the controller ``c``."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def used(self, fleet: Fleet, skip: PartKey | None = None) -> dict[str, float]:
        c = self.c
        used: dict[str, float] = {}
        for a in c.assignments.values():
            if a.phase is Phase.LOST or a.key == skip:
                continue
            entry = c.workloads.get(a.workload)
            if entry is None or entry.spec.profile is None:
                continue
            used[a.device] = used.get(a.device, 0.0) + entry.spec.profile.memory_of(a.first, a.last)
        return used

    def repair(self, fleet: Fleet, now: float) -> list[Command]:
        """Re-place every LOST partition on another device, keeping its segments."""
        c = self.c
        out: list[Command] = []
        lost = sorted((a for a in c.assignments.values() if a.phase is Phase.LOST), key=lambda a: a.key)
        failed: set[str] = set()
        for a in lost:
            if a.workload in failed:
                continue
            entry = c.workloads.get(a.workload)
            if entry is None or entry.spec.profile is None:
                continue
            c.counters["repairs"] += 1
            dev = self.repair_one(a, entry, fleet)
            if dev is None:
                failed.add(a.workload)
                continue
            old = fleet.get(a.device)
            if old is not None and old.alive:  # given up on a live device: clear what it half-loaded
                c._pending_undeploy.append(c.applier.undeploy(a.device, a.key))
            new = Assignment(a.key, dev, a.first, a.last, lost_at=a.lost_at, excluded=a.excluded,
                             next_try=now)
            c.assignments[a.key] = new
            c._first_sent.pop(a.key, None)
            out.append(Persist(a.workload))
        for name in sorted(failed):
            # No device takes the lost partition with its cuts: re-plan the workload whole.
            if c.chains(name):
                # A healthy replica still serves: never tear it down for the broken one. The lost
                # partitions stay LOST (repaired above as soon as a device can take them); a whole
                # re-plan is tried at the re-plan interval, and keeps what serves if it fails.
                if now - c._last_plan >= c.config.replan_interval_s:
                    c._need_plan = True
                continue
            c.counters["repair_fallbacks"] += 1
            for key in [k for k, x in c.assignments.items() if k[0] == name]:
                x = c.assignments.pop(key)
                if x.phase is not Phase.LOST:
                    c._pending_undeploy.append(c.applier.undeploy(x.device, key))
                elif not math.isnan(x.lost_at):
                    c._fallback_lost_at = x.lost_at
            c._need_plan = True
            out.append(Persist(name))
        return out

    def repair_one(self, a: Assignment, entry: WorkloadEntry, fleet: Fleet) -> str | None:
        c = self.c
        w = entry.spec
        assert w.profile is not None
        mine = [x for x in c.assignments.values() if x.key[0] == w.name and x.key[1] == entry.version]
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
        used = self.used(fleet, skip=a.key)
        devices = []
        for d in fleet.devices:
            # the device it was lost on only when it died and has come back (a new epoch: nothing
            # of it is left); a partition that failed there, or gave up on it, goes elsewhere
            banned = (d.id in same_chain or d.id in a.excluded
                      or (d.id == a.device and a.reason not in DIED_REASONS)
                      or (w.replicas > 1 and d.power_domain in other_domains))
            u = used.get(d.id, 0.0)
            if not banned and u == 0.0:
                devices.append(d)  # what ``replace`` would build (memory_bytes >= 0): skip the copy
                continue
            devices.append(replace(d, memory_bytes=int(max(0.0, d.memory_bytes - u)), alive=d.alive and not banned))
        if src not in fleet.index or snk not in fleet.index:
            return None
        sub = Workload(name=f"{w.name}#repair", source=src, sink=snk, tenant=w.tenant,
                       priority=w.priority, replicas=1, objective=w.objective, selectors=w.selectors,
                       tolerations=w.tolerations, max_partitions=1,
                       profile=sub_profile(w.profile, a.first, a.last))

        def place(candidates: list[Device]) -> str | None:
            plan = c.schedule(Fleet(tuple(candidates)), [sub], current=None, quotas=None)
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
