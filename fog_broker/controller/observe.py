"""The controller's observe stage: devices' reports against the assignments.

A reported partition is ours (it runs: mark it), an old version's (the switch's), or an orphan
(undeployed after a grace); a running partition its device stops listing is deployed again.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from runtime.messages import PartitionStatus

from ..placement.model import Fleet
from .model import AWAIT_BUILD, Command, PartKey, Phase, Switch

if TYPE_CHECKING:
    from ._core import Controller

__all__ = ["Observer"]


class Observer:
    """Reads reports into the book of the controller ``c``."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def all_heard(self, fleet: Fleet, reported: Mapping[str, Sequence[PartitionStatus]]) -> bool:
        """Every device a stored assignment names, and every source and sink, has reported."""
        c = self.c
        for a in c.all_parts():
            if a.phase is Phase.UNCONFIRMED and a.device not in reported:
                return False
        return all(e.spec.source in reported and e.spec.sink in reported for e in c.workloads.values())

    def observe(self, fleet: Fleet, reported: Mapping[str, Sequence[PartitionStatus]],
                 now: float) -> list[Command]:
        c = self.c
        out: list[Command] = []
        seen: set[PartKey] = set()
        switches = c.switches
        for dev, parts in reported.items():
            for p in parts:
                key = (p.workload, p.version, p.replica, p.index)
                a = c.assignments.get(key)
                if a is None and switches:
                    sw = switches.get(p.workload)
                    if sw is not None and self.observe_old(sw, dev, key, p, now, seen):
                        continue
                if a is not None and a.device == dev and a.sha256 == AWAIT_BUILD:
                    continue  # the old partition under a re-planned key: neither ours nor an orphan
                mine = a is not None and a.device == dev and (not a.sha256 or a.sha256 == p.sha256)
                if not mine:
                    if c.ready:
                        out.extend(self.orphan(dev, key, now))
                    continue
                assert a is not None
                seen.add(key)
                c._orphans_seen.pop((dev, key), None)
                if p.health == "running" and a.phase in (Phase.DEPLOYING, Phase.UNCONFIRMED, Phase.PENDING):
                    if not a.sha256:
                        a.sha256 = p.sha256
                    c.applier.mark_running(a, now)
                elif p.health == "failed" and a.phase is Phase.RUNNING:
                    a.reason = f"reported failed by {dev}"
                    a.attempts = 0
                    out.extend(c.applier.retry_or_move(a, now))
        # A RUNNING partition its (live, reporting) device no longer lists: it lost it (restart).
        for a in c.assignments.values():
            if a.phase is not Phase.RUNNING or a.key in seen or a.device not in reported:
                c._missing_since.pop(a.key, None)
                continue
            since = c._missing_since.setdefault(a.key, now)
            if now - since >= c.config.missing_grace_s and now - a.running_since >= c.config.missing_grace_s:
                c._missing_since.pop(a.key, None)
                a.phase, a.attempts, a.next_try = Phase.PENDING, 0, now
                a.reason = "no longer reported by the device"
        if switches:
            self.observe_switches(reported, now, seen)
        return out

    def observe_old(self, sw: Switch, dev: str, key: PartKey, p: PartitionStatus, now: float,
                     seen: set[PartKey]) -> bool:
        """A reported partition of an older version: True when the switch knows it (not an orphan)."""
        c = self.c
        a = sw.parts.get(key)
        if a is not None and a.device == dev and (not a.sha256 or a.sha256 == p.sha256):
            seen.add(key)
            c._orphans_seen.pop((dev, key), None)
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

    def observe_switches(self, reported: Mapping[str, Sequence[PartitionStatus]], now: float,
                          seen: set[PartKey]) -> None:
        """Old partitions missing from fresh reports are lost; undeployed ones no longer reported are gone."""
        c = self.c
        grace = c.config.missing_grace_s
        gone_timeout = 2 * c.config.orphan_grace_s + grace
        for sw in c.switches.values():
            for a in sw.parts.values():
                if a.phase is not Phase.RUNNING or a.key in seen or a.device not in reported:
                    c._missing_since.pop(a.key, None)
                    continue
                since = c._missing_since.setdefault(a.key, now)
                if now - since >= grace and now - a.running_since >= grace:
                    c._missing_since.pop(a.key, None)
                    a.phase, a.lost_at, a.reason = Phase.LOST, now, "no longer reported by the device"
            for key, (_a, at) in list(sw.gone.items()):
                # Gone from its device's report (its memory is free: plan again), or reported long
                # after the undeploy (the orphan rule takes it over from here).
                if key not in seen or now - at >= gone_timeout:
                    del sw.gone[key]
                    c._need_plan = True

    def orphan(self, dev: str, key: PartKey, now: float) -> list[Command]:
        c = self.c
        first = c._orphans_seen.setdefault((dev, key), now)
        if now - first < c.config.orphan_grace_s:
            return []
        c._orphans_seen[(dev, key)] = now + 10 * c.config.orphan_grace_s  # re-send rarely
        c.counters["orphans"] += 1
        return [c.applier.undeploy(dev, key)]
