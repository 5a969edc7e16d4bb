"""A workload's version switch: the old version serves until the new one runs.

A new version switches make-before-break (``MAKE_BEFORE_BREAK``)::

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

The modes change only through ``TRANSITIONS`` (``step``); what a pass does in each mode
(``Switcher.advance``): retire what drained, cut over once the new version runs, and in
``ROLLING`` one more ``roll`` step.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from runtime.messages import Hop

from ..placement.model import Fleet
from ..placement.plugins import GATE_ANTI_AFFINITY, GATE_FIT
from .model import (
    BREAK_BEFORE_MAKE,
    MAKE_BEFORE_BREAK,
    ROLLING,
    SWITCH_REASON,
    Assignment,
    Command,
    Persist,
    Phase,
    Switch,
    WorkloadEntry,
    by_replica,
    complete,
    serving_chains,
)

if TYPE_CHECKING:
    from ._core import Controller

__all__ = ["Step", "TRANSITIONS", "step", "Switcher"]


class Step(enum.Enum):
    """What moves a switch from one mode to another."""

    BEGIN = "begin"  # a new version arrives (again): made beside what serves
    ADOPT = "adopt"  # rebuilt from the store after a restart
    ROLL = "roll"    # the new version fits only without the old one: replica by replica
    HOLD = "hold"    # rolling is stuck and breaking cannot help: back to plain re-plans
    BREAK = "break"  # the last old replica goes before the new one is made


#: (mode, step) -> the mode after it. A pair not listed is a bug (``step`` raises), never a no-op.
TRANSITIONS: Mapping[tuple[str, Step], str] = MappingProxyType({
    (MAKE_BEFORE_BREAK, Step.BEGIN): MAKE_BEFORE_BREAK,
    (ROLLING, Step.BEGIN): MAKE_BEFORE_BREAK,
    (BREAK_BEFORE_MAKE, Step.BEGIN): MAKE_BEFORE_BREAK,
    (MAKE_BEFORE_BREAK, Step.ADOPT): MAKE_BEFORE_BREAK,
    (MAKE_BEFORE_BREAK, Step.ROLL): ROLLING,
    (ROLLING, Step.HOLD): MAKE_BEFORE_BREAK,
    (ROLLING, Step.BREAK): BREAK_BEFORE_MAKE,
})

#: The modes in which each pass takes one more step of its own (``Switcher.roll``).
_STEPS_ON = frozenset({ROLLING})


def step(sw: Switch, s: Step) -> None:
    """Move ``sw`` to the mode ``TRANSITIONS`` gives for ``s`` from its mode."""
    try:
        sw.mode = TRANSITIONS[sw.mode, s]
    except KeyError:
        raise ValueError(f"a switch in {sw.mode} cannot {s.value}") from None


class Switcher:
    """The version switches of the controller ``c`` (``c.switches``)."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def view(self, workload: str) -> dict[str, object] | None:
        """``Controller.switch_view``: the switch in progress for ``fogline status`` (None: none)."""
        c = self.c
        sw = c.switches.get(workload)
        entry = c.workloads.get(workload)
        if sw is None or entry is None:
            return None
        serving = c.chains(workload)
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

    def old_chains(self, workload: str, sw: Switch) -> list[tuple[int, tuple[Hop, ...]]]:
        """The switch's old chains that serve: of its version, not retired, every partition RUNNING."""
        return serving_chains(workload, sw.version, sw.segments,
                       [a for k, a in sw.parts.items() if k[1] == sw.version and k not in sw.retire_at])

    def begin(self, old: WorkloadEntry) -> list[Command]:
        """``old`` is replaced by a new version: keep what serves, undeploy what cannot serve.

        The version that serves on is the switch's old one if it still has a live replica (a
        third version arriving before the second runs), else ``old``'s. Partitions of the
        other version that served (rolling) retire with a drain; the rest goes at once.
        """
        c = self.c
        name = old.spec.name
        out: list[Command] = []
        cur = sorted((a for k, a in c.assignments.items() if k[0] == name), key=lambda a: a.key)
        for a in cur:
            del c.assignments[a.key]
            c._first_sent.pop(a.key, None)
        nseg = len(old.spec.profile.segments) if old.spec.profile is not None else 0
        sw = c.switches.get(name)
        if sw is not None and self.live_old(sw):
            served = {r for r, _ in c.chains_of(name, old, cur)} if sw.mode == ROLLING else set()
            for a in cur:
                if a.replica in served:
                    sw.parts[a.key] = a
                    sw.retire_at[a.key] = math.nan
                else:
                    out.extend(self.undeploy_old(sw, a, math.nan))
        else:
            if sw is None:
                sw = Switch(old.version, nseg, old.spec)
            else:  # what is left of the older version serves no more
                for key in [k for k in sw.parts if k not in sw.retire_at]:
                    out.extend(self.undeploy_old(sw, sw.parts.pop(key), math.nan))
                sw.version, sw.segments, sw.spec = old.version, nseg, old.spec
            live = {r for r, parts in by_replica(cur).items() if complete(parts, nseg)
                    and all(a.phase in (Phase.RUNNING, Phase.UNCONFIRMED) for a in parts)}
            for a in cur:
                if a.replica in live:
                    sw.parts[a.key] = a
                else:
                    out.extend(self.undeploy_old(sw, a, math.nan))
        sw.specs[old.version] = old.spec
        step(sw, Step.BEGIN)
        sw.since, sw.reason, sw.next_try = math.nan, "", -math.inf
        if sw.parts or sw.gone:
            c.switches[name] = sw
            c.counters["switches"] += 1
        else:
            c.switches.pop(name, None)
        out.append(Persist(name))
        return out

    def adopt(self, parts: Sequence[Assignment]) -> Switch:
        """A switch rebuilt from stored old partitions (a restart): the version with the most
        complete replicas serves (the newest on a tie); the other versions' retire."""
        versions: dict[int, list[Assignment]] = {}
        for a in parts:
            versions.setdefault(a.key[1], []).append(a)
        segs = {v: max(a.last for a in ps) + 1 for v, ps in versions.items()}
        score = {v: sum(1 for rp in by_replica(ps).values() if complete(rp, segs[v])) for v, ps in versions.items()}
        v = max(versions, key=lambda v: (score[v], v))
        sw = Switch(v, segs[v], None)
        step(sw, Step.ADOPT)
        for a in parts:
            sw.parts[a.key] = a
            if a.key[1] != v:
                sw.retire_at[a.key] = math.nan
        return sw

    def undeploy_old(self, sw: Switch, a: Assignment, now: float) -> list[Command]:
        """Undeploy an old partition now (nothing if it is lost) and remember it until it is gone."""
        c = self.c
        if a.phase is Phase.LOST:
            return []
        sw.gone[a.key] = (a, now)
        return [c.applier.undeploy(a.device, a.key)]

    def live_old(self, sw: Switch) -> dict[int, list[Assignment]]:
        """The switch's old replicas that serve or will once reported: complete, none lost, not retired."""
        mine = [a for k, a in sw.parts.items() if k[1] == sw.version and k not in sw.retire_at]
        return {r: parts for r, parts in by_replica(mine).items() if complete(parts, sw.segments)
                and all(a.phase in (Phase.RUNNING, Phase.UNCONFIRMED) for a in parts)}

    def retire(self, sw: Switch, parts: Iterable[Assignment], now: float) -> None:
        """No new request goes to ``parts``; they are undeployed ``drain_s`` from ``now``."""
        c = self.c
        for a in parts:
            sw.retire_at[a.key] = now + c.config.drain_s

    def advance(self, fleet: Fleet, now: float) -> list[Command]:
        """Each switch one step on: drop broken old replicas, cut over, roll, undeploy what drained."""
        c = self.c
        out: list[Command] = []
        for name in list(c.switches):
            sw = c.switches[name]
            entry = c.workloads[name]
            before = (len(sw.parts), len(sw.retire_at))
            if math.isnan(sw.since):
                sw.since = now
            for k, t in sw.retire_at.items():
                if math.isnan(t):
                    sw.retire_at[k] = now + c.config.drain_s
            for k, (a, t) in sw.gone.items():
                if math.isnan(t):
                    sw.gone[k] = (a, now)
            # An old replica with a lost partition never serves again (old versions are not
            # repaired): its other partitions go now. Retired partitions that were lost: forget.
            for k in [k for k, a in sw.parts.items() if k in sw.retire_at and a.phase is Phase.LOST]:
                del sw.parts[k], sw.retire_at[k]
            live = self.live_old(sw)
            for k in [k for k, a in sw.parts.items() if k not in sw.retire_at and a.replica not in live]:
                out.extend(self.undeploy_old(sw, sw.parts.pop(k), now))
            mine = c.mine_of(name, entry)
            healthy = c.chains_of(name, entry, mine)
            if len(healthy) >= entry.spec.replicas:
                # Made: every replica of the new version runs. The old one breaks (drained).
                for parts in live.values():
                    self.retire(sw, parts, now)
                sw.reason = ""
            elif sw.mode in _STEPS_ON and now >= sw.next_try:  # rolling: one more step
                out.extend(self.roll(sw, entry, mine, bool(healthy), live, fleet, now))
            for k, t in list(sw.retire_at.items()):
                if t <= now:  # drained: requests routed before it retired had their time
                    del sw.retire_at[k]
                    c.counters["retired"] += 1
                    out.extend(self.undeploy_old(sw, sw.parts.pop(k), now))
            placed = len({a.replica for a in mine})
            if not sw.parts and not sw.gone and (sw.mode != ROLLING or placed >= entry.spec.replicas):
                del c.switches[name]
                entry.reasons.pop(SWITCH_REASON, None)
                out.append(Persist(name))
                continue
            if sw.reason:
                entry.reasons[SWITCH_REASON] = sw.reason
            else:
                entry.reasons.pop(SWITCH_REASON, None)
            if (len(sw.parts), len(sw.retire_at)) != before:
                out.append(Persist(name))
        return out

    def unplaced(self, entry: WorkloadEntry, sw: Switch, reasons: Mapping[str, str], fleet: Fleet,
                 now: float) -> None:
        """The new version did not fit next to the old one: roll if that can help, else say why not."""
        c = self.c
        if sw.mode != MAKE_BEFORE_BREAK or not self.live_old(sw):
            return  # already falling back, or nothing old serves (nothing to protect: plain re-plans)
        new, old = entry.version, sw.version
        fits = self.fits_without_old(entry, sw, fleet)
        if fits is False or (fits is None and not ({GATE_FIT, GATE_ANTI_AFFINITY} & set(reasons))):
            sw.reason = f"v{new} cannot be placed, not even without v{old}: v{old} keeps serving"
            return
        step(sw, Step.ROLL)
        sw.next_try = -math.inf
        sw.reason = f"v{new} does not fit next to v{old}: switching replica by replica"
        if not sw.fell_back:
            sw.fell_back = True
            c.counters["switches_rolling"] += 1

    def roll(self, sw: Switch, entry: WorkloadEntry, mine: Sequence[Assignment], new_serves: bool,
             live: Mapping[int, Sequence[Assignment]], fleet: Fleet, now: float) -> list[Command]:
        """One rolling step: place a new replica, or retire an old one, never the last that serves."""
        c = self.c
        if any(a.phase is not Phase.RUNNING for a in mine) or sw.retire_at or sw.gone:
            return []  # a step in progress: a new replica deploying, or old memory being freed
        new, old, n = entry.version, sw.version, entry.spec.replicas
        placed = {a.replica for a in mine}
        # An index no old replica holds first; one an old replica holds is fine too (fewer new
        # replicas than old ones): once the new chain runs, ``chains`` drops the old one of that index.
        free = sorted((r for r in range(n) if r not in placed), key=lambda r: (r in live, r))
        if free:
            cmds, _ = c.scaler.place_replica(entry, free[0], fleet, now)
            if cmds:
                sw.reason = f"v{new} does not fit next to v{old}: v{new} replica {free[0]} deploying"
                return cmds
        if len(live) >= 2 or (live and new_serves):
            r = max(live)
            self.retire(sw, live[r], now)
            sw.reason = f"v{new} does not fit next to v{old}: v{old} replica {r} retired to make room"
            return []
        if live:
            return self.break_(sw, entry, live, fleet, now)
        sw.reason = f"v{new} replica {free[0] if free else '?'} waits for room (v{old} is gone)"
        sw.next_try = now + c.config.replan_interval_s
        return []

    def break_(self, sw: Switch, entry: WorkloadEntry, live: Mapping[int, Sequence[Assignment]], fleet: Fleet,
               now: float) -> list[Command]:
        """The last old replica and no room for a new one next to it: break before making, if that helps."""
        c = self.c
        new, old = entry.version, sw.version
        wait = c.config.switch_break_after_s
        sw.next_try = now + c.config.replan_interval_s
        fits = self.fits_without_old(entry, sw, fleet)
        if fits is not True or math.isinf(wait):
            why = ("break-before-make is off" if math.isinf(wait) and fits else
                   f"not even without v{old}" if fits is False else
                   f"unknown whether it fits without v{old} (adopted after a restart)")
            sw.reason = f"v{new} does not fit next to v{old} ({why}): v{old} keeps serving"
            # Back to plain make-before-break: the re-plans of a pending workload try again, and
            # room that appears (a device joins, another workload goes) is taken at once.
            step(sw, Step.HOLD)
            return []
        if now - sw.since < wait:
            sw.reason = (f"v{new} does not fit next to v{old}: break-before-make in "
                         f"{sw.since + wait - now:.1f} s")
            sw.next_try = min(sw.next_try, sw.since + wait)
            return []
        step(sw, Step.BREAK)
        c.counters["switches_broken"] += 1
        # No drain here: v1 serves up to its undeploy (this pass) and only the requests in flight
        # then fail, where a drain would refuse every request of the drain on top.
        for parts in live.values():
            for a in parts:
                sw.retire_at[a.key] = now
        sw.reason = (f"break-before-make: v{new} does not fit next to v{old}, not even one replica; "
                     f"v{old} is undeployed, requests are refused until v{new} runs")
        return []

    def fits_without_old(self, entry: WorkloadEntry, sw: Switch, fleet: Fleet) -> bool | None:
        """Whether the whole new version would be placed with the old version's memory free (None: unknown)."""
        c = self.c
        if sw.spec is None or sw.spec.profile is None:
            return None
        extra: dict[str, float] = {}
        held = list(sw.parts.values()) + [a for a, _ in sw.gone.values()]
        for a in held:  # every old version's memory (a third version: the second's draining too)
            old = sw.specs.get(a.key[1])
            if old is not None and old.profile is not None and a.phase is not Phase.LOST:
                extra[a.device] = extra.get(a.device, 0.0) + old.profile.memory_of(a.first, a.last)
        devices = tuple(replace(d, memory_bytes=int(d.memory_bytes + extra[d.id])) if d.id in extra else d
                        for d in fleet.devices)
        name = entry.spec.name
        plan = c.schedule(Fleet(devices), c.plan_specs(full=name), current=c.current(),
                          quotas=c.quotas or None)
        return any(r.name == name and r.placed for r in plan.workloads)
