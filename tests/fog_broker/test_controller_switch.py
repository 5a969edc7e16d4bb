"""Version switches of the deployment controller (make-before-break), pure: no broker, time by hand.

``Site`` plays the devices and the registry around a real ``Controller`` and the real scheduler:
deploys load after ``load_s`` (then ack), undeploys free the memory at once, every device reports
what it runs, and the fleet snapshot is built the registry's way (free memory plus ``reserved``).
Every pass checks what a request would meet: each chain ``chains()`` returns runs on its devices,
and an old partition is undeployed only after it stopped serving ``drain_s`` before (unless the
switch breaks before making: then it serves up to its undeploy).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from fog_broker.controller import (
    BREAK_BEFORE_MAKE,
    MAKE_BEFORE_BREAK,
    ROLLING,
    Assignment,
    Controller,
    ControllerConfig,
    DeployPartition,
    PartKey,
    Persist,
    UndeployPartition,
)
from fog_broker.placement.model import ChainProfile, Device, Fleet, Segment, Workload
from fog_broker.placement.scheduler import schedule
from fog_broker.router import ReplyClient, Router, SendActivation
from runtime.messages import Hop, InferenceRequest, InferenceResult, PartitionStatus

MB = 1_000_000
DT = 0.1
DRAIN = 0.5


def dev(i: str, mem: float, domain: str | None = None) -> Device:
    return Device(id=i, flops=1e10, memory_bytes=mem, uplink_bps=1e9, downlink_bps=1e9, rtt_s=0.001,
                  power_active_w=5.0, power_idle_w=0.0, labels=(("power-domain", domain or f"pd-{i}"),))


def profile(model: str, mb: float, n: int = 2) -> ChainProfile:
    """``n`` segments of ``mb`` MB of parameters in all."""
    return ChainProfile(model, 1000.0, tuple(Segment(f"s{i}", 1e8, mb / n * MB, 0.0, 1000.0) for i in range(n)))


def spec(version: int, replicas: int = 1, mb: float = 40.0, **kw: Any) -> Workload:
    return Workload(name="w", source="src", sink="src", replicas=replicas, model=f"zoo:m{version}",
                    profile=profile(f"m{version}", mb), **kw)


SRC = dev("src", 0.0)


@dataclass
class Site:
    """Devices (birth memory, what they run) and the registry's fleet view around one controller."""

    devices: list[Device]
    config: ControllerConfig = field(default_factory=lambda: ControllerConfig(drain_s=DRAIN))
    load_s: float = 0.3
    now: float = 0.0

    def __post_init__(self) -> None:
        self.c = Controller(schedule, self.config)
        self.alive = {d.id: True for d in self.devices}
        self.running: dict[str, dict[PartKey, float]] = {d.id: {} for d in self.devices}
        self.loading: list[tuple[float, DeployPartition, float]] = []
        self.specs: dict[int, Workload] = {}
        self.served_at: dict[PartKey, float] = {}      # last pass a key was on a serving chain
        self.versions: list[tuple[float, frozenset[int]]] = []  # (time, versions served)
        self.modes: set[str] = set()
        self.persisted: dict[str, list[Assignment]] = {}
        self.deployed: list[tuple[float, int]] = []  # (when, version) of every deploy

    # ------------------------------------------------------------ the devices

    def fleet(self) -> Fleet:
        rep = self.reported()
        reserved = self.c.reserved(rep)
        out = []
        for d in self.devices:
            free = d.memory_bytes - sum(self.running[d.id].values())
            out.append(replace(d, memory_bytes=max(0.0, min(d.memory_bytes, free + reserved.get(d.id, 0.0))),
                               alive=self.alive[d.id]))
        return Fleet(tuple(out))

    def reported(self) -> dict[str, tuple[PartitionStatus, ...]]:
        return {d: tuple(PartitionStatus(*k, sha256="0" * 64, health="running") for k in parts)
                for d, parts in self.running.items() if self.alive[d]}

    def apply(self, cmds: list[Any], drain: bool = True) -> None:
        for cmd in cmds:
            if isinstance(cmd, DeployPartition):
                w = self.specs[cmd.version]
                assert w.profile is not None
                self.deployed.append((self.now, cmd.version))
                self.loading.append((self.now + self.load_s, cmd, w.profile.memory_of(cmd.first, cmd.last)))
            elif isinstance(cmd, UndeployPartition):
                key = (cmd.workload, cmd.version, cmd.replica, cmd.index)
                sw = self.c.switches.get("w")
                drain = drain and (sw is None or sw.mode != BREAK_BEFORE_MAKE)  # no drain when breaking
                if drain and cmd.version < max(self.specs) and key in self.served_at:
                    # the drain: requests routed to it before it retired had their time
                    assert self.now - self.served_at[key] >= DRAIN - 1e-9, (key, self.now, self.served_at[key])
                self.running[cmd.device].pop(key, None)
                # commands reach a device in order: an undeploy after a deploy still loading cancels it
                self.loading = [x for x in self.loading if (x[1].device, x[1].workload, x[1].version,
                                                            x[1].replica, x[1].index) != (cmd.device, *key)]
            elif isinstance(cmd, Persist):
                self.persisted[cmd.workload] = [replace(a) for a in self.c.persisted_of(cmd.workload)]

    def _loads(self) -> None:
        done = [x for x in self.loading if x[0] <= self.now]
        self.loading = [x for x in self.loading if x[0] > self.now]
        for _, cmd, mem in done:
            if not self.alive[cmd.device]:
                continue
            free = self.devices_by_id[cmd.device].memory_bytes - sum(self.running[cmd.device].values())
            ok = mem <= free + 1e-6
            if ok:
                self.running[cmd.device][(cmd.workload, cmd.version, cmd.replica, cmd.index)] = mem
            self.apply(self.c.ack(cmd.command_id, cmd.device, ok, "" if ok else "insufficient memory", self.now))

    @property
    def devices_by_id(self) -> dict[str, Device]:
        return {d.id: d for d in self.devices}

    # ------------------------------------------------------------ time

    def step(self) -> None:
        self.now = round(self.now + DT, 6)
        self._loads()
        self.apply(self.c.reconcile(self.fleet(), self.reported(), self.now))
        self.check()

    def check(self) -> None:
        """What a request routed now would meet: every hop of every chain is loaded on its device."""
        served: set[int] = set()
        for _, chain in self.c.chains("w"):
            for h in chain:
                key = (h.workload, h.version, h.replica, h.index)
                assert key in self.running[h.device_id] and self.alive[h.device_id], (self.now, h)
                self.served_at[key] = self.now
                served.add(h.version)
        self.versions.append((self.now, frozenset(served)))
        sw = self.c.switches.get("w")
        if sw is not None:
            self.modes.add(sw.mode)

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / DT)):
            self.step()

    def run_until(self, pred: Callable[[], bool], limit: float = 30.0) -> None:
        end = self.now + limit
        while not pred():
            assert self.now < end, f"not reached by {self.now}: {self.c.switches}"
            self.step()

    # ------------------------------------------------------------ actions

    def set(self, version: int, **kw: Any) -> None:
        self.specs[version] = spec(version, **kw)
        self.apply(self.c.set_workload(self.specs[version], version))

    def lose(self, device: str) -> None:
        self.alive[device] = False
        self.running[device] = {}
        self.loading = [x for x in self.loading if x[1].device != device]
        self.c.device_lost(device, self.now)

    def restart(self) -> None:
        """A new controller from the store (the latest spec, persisted assignments), like the service."""
        stored = [Assignment(a.key, a.device, a.first, a.last, sha256=a.sha256)
                  for rows in self.persisted.values() for a in rows]
        self.c = Controller(schedule, replace(self.config, startup_wait_s=5.0))
        v = max(self.specs)
        self.c.set_workload(self.specs[v], v)
        self.c.start_after_restart(self.now, stored)
        self.loading = []  # acks of the old run's deploys go nowhere

    # ------------------------------------------------------------ what happened

    def serving(self) -> frozenset[int]:
        return self.versions[-1][1]

    def gap(self, since: float = 0.0) -> float:
        """Longest stretch (s) after ``since`` with no chain serving."""
        worst = run = 0.0
        for t, vs in self.versions:
            if t <= since:
                continue
            run = 0.0 if vs else run + DT
            worst = max(worst, run)
        return round(worst, 6)

    def old_on_devices(self, below: int) -> list[tuple[str, PartKey]]:
        return [(d, k) for d, parts in self.running.items() for k in parts if k[1] < below]

    def settled(self, version: int, replicas: int) -> bool:
        return "w" not in self.c.switches and self.c.workloads["w"].spec.replicas == replicas \
            and self.c.healthy_replicas("w") == replicas \
            and self.serving() == {version} and not self.old_on_devices(version)


def roomy(n: int = 3, mem: float = 100.0) -> list[Device]:
    return [SRC] + [dev(f"d{i}", mem * MB) for i in range(n)]


def started(devices: list[Device], replicas: int = 1, config: ControllerConfig | None = None,
            mb: float = 40.0) -> Site:
    s = Site(devices, config or ControllerConfig(drain_s=DRAIN))
    s.set(1, replicas=replicas, mb=mb)
    s.run_until(lambda: s.c.healthy_replicas("w") == replicas)
    s.run(0.5)
    return s


# ------------------------------------------------------------------ the switch table
#
# Each case: the site, v1's replicas, what happens from v2 on, the gap allowed (s without a serving
# chain, 0: none), the switch's modes seen after passes, and the version/replicas it must settle on.


def _plain(s: Site) -> None:
    s.set(2, replicas=s.specs[1].replicas)


def _third_before_second_runs(s: Site) -> None:
    s.set(2)
    s.step()  # v2 placed and deploying, not running yet
    assert s.c.healthy_replicas("w") == 0 and s.serving() == {1}
    s.set(3)
    s.step()
    assert s.serving() == {1}


def _third_while_old_drains(s: Site) -> None:
    s.set(2)
    s.run_until(lambda: s.serving() == {2})  # cut over: v1 drains
    assert any(k[1] == 1 for k in s.c.switches["w"].retire_at)
    s.set(3)
    s.step()
    assert s.serving() == {2}  # v2 serves until v3 runs; v1 keeps draining


def _third_during_rolling(s: Site) -> None:
    s.set(2, replicas=3)
    s.run_until(lambda: s.serving() == {1, 2})  # one v2 replica runs next to v1's replicas left
    s.set(3, replicas=3)
    s.step()
    assert s.serving() == {1}  # v1 serves on; v2's replica drains


def _old_device_lost(s: Site) -> None:
    s.set(2, replicas=2)
    s.step()
    victim = s.c.chains("w")[0][1][0].device_id  # a device of v1's primary chain
    s.lose(victim)
    s.step()
    assert s.serving() == {1}, "v1's other replica serves"


def _only_old_replica_lost(s: Site) -> None:
    s.set(2)
    s.step()
    (victim,) = {h.device_id for _, ch in s.c.chains("w") for h in ch if h.version == 1}
    s.lose(victim)


def _new_device_lost(s: Site) -> None:
    s.set(2)
    s.step()
    new_devices = {a.device for a in s.c.assignments_of("w")} - {a.device for a in s.c.switches["w"].parts.values()}
    s.lose(min(new_devices))  # v1 fills its device: v2 is elsewhere
    s.step()
    assert s.serving() == {1}


def _restart_before_new_runs(s: Site) -> None:
    s.set(2)
    s.step()
    assert s.serving() == {1}
    s.restart()
    s.step()
    assert s.serving() == {1}, "adopted v1 serves again as soon as it is reported"


def _restart_while_old_drains(s: Site) -> None:
    s.set(2)
    s.run_until(lambda: s.serving() == {2})
    s.restart()
    s.step()
    assert s.serving() == {2}, "v2 runs on all its replicas: it serves at once, v1 drains again"


def _restart_during_rolling(s: Site) -> None:
    s.set(2, replicas=2)
    s.run_until(lambda: 2 in s.serving())
    s.restart()


CASES = [
    # name, devices, v1 replicas, story, gap allowed (s), modes seen after passes, settle on, config
    ("roomy", roomy(), 1, _plain, 0.0, {MAKE_BEFORE_BREAK}, (2, 1), {}),
    ("roomy two replicas", roomy(4), 2, _plain, 0.0, {MAKE_BEFORE_BREAK}, (2, 2), {}),
    ("full site, replica by replica", roomy(2, 45.0), 2, _plain, 0.0, {ROLLING}, (2, 2), {}),
    ("more replicas than before, rolling", roomy(2, 45.0), 1, lambda s: s.set(2, replicas=2), 0.0,
     {ROLLING}, (2, 2), {}),
    ("fewer replicas than before, rolling", roomy(3, 45.0), 3, lambda s: s.set(2, replicas=1), 0.0,
     {ROLLING}, (2, 1), {}),
    ("one replica, full site: break before make", roomy(1, 45.0), 1, _plain, 1.0, {BREAK_BEFORE_MAKE},
     (2, 1), {}),
    ("break after a wait", roomy(1, 45.0), 1, _plain, 1.0, {ROLLING, BREAK_BEFORE_MAKE}, (2, 1),
     {"switch_break_after_s": 1.0}),
    ("third version before the second runs", roomy(), 1, _third_before_second_runs, 0.0,
     {MAKE_BEFORE_BREAK}, (3, 1), {}),
    ("third version while the old one drains", roomy(), 1, _third_while_old_drains, 0.0,
     {MAKE_BEFORE_BREAK}, (3, 1), {}),
    ("third version during a rolling switch", roomy(3, 45.0), 3, _third_during_rolling, 0.0,
     {ROLLING}, (3, 3), {}),
    ("old replica's device lost", roomy(4), 2, _old_device_lost, 0.0, {MAKE_BEFORE_BREAK}, (2, 2), {}),
    ("the only old replica's device lost", roomy(), 1, _only_old_replica_lost, 0.5, {MAKE_BEFORE_BREAK},
     (2, 1), {}),
    ("new partition's device lost", roomy(4, 45.0), 1, _new_device_lost, 0.0, {MAKE_BEFORE_BREAK}, (2, 1), {}),
    ("fog restart before the new version runs", roomy(), 1, _restart_before_new_runs, 0.0,
     {MAKE_BEFORE_BREAK}, (2, 1), {}),
    ("fog restart while the old version drains", roomy(), 1, _restart_while_old_drains, 0.0,
     {MAKE_BEFORE_BREAK}, (2, 1), {}),
    ("fog restart during a rolling switch", roomy(2, 45.0), 2, _restart_during_rolling, 0.0,
     {ROLLING}, (2, 2), {}),
]


@pytest.mark.parametrize("name,devices,replicas,story,gap,modes,settle,cfg", CASES, ids=[c[0] for c in CASES])
def test_switch(name: str, devices: list[Device], replicas: int, story: Callable[[Site], None], gap: float,
                modes: set[str], settle: tuple[int, int], cfg: dict[str, Any]) -> None:
    s = started(devices, replicas, ControllerConfig(drain_s=DRAIN, **cfg))
    t0 = s.now
    story(s)
    t1 = s.now
    version, reps = settle
    s.run_until(lambda: s.settled(version, reps))
    assert s.gap(t0) <= gap, (s.gap(t0), [(t, sorted(v)) for t, v in s.versions if t > t0])
    assert s.modes == modes
    # once the target version serves, it keeps serving (never back to an older one)
    after = [vs for t, vs in s.versions if t > t1 and vs]
    first = next(i for i, vs in enumerate(after) if version in vs)
    assert all(version in vs for vs in after[first:]), after
    assert "switch" not in s.c.workloads["w"].reasons
    assert {a.key[1] for a in s.c.persisted_of("w")} == {version}
    assert [v for t, v in s.deployed if t >= t0 and v == 1] == []  # an old version is never redeployed


# ------------------------------------------------------------------ fallbacks that wait


@pytest.mark.parametrize("name,devices,mb,cfg,want", [
    ("does not fit even without the old version", roomy(1, 45.0), 60.0, {}, "not even without v1"),
    ("break-before-make switched off", roomy(1, 45.0), 40.0, {"switch_break_after_s": math.inf},
     "break-before-make is off"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_switch_that_cannot_help_keeps_the_old_version(name: str, devices: list[Device], mb: float,
                                                       cfg: dict[str, Any], want: str) -> None:
    s = started(devices, 1, ControllerConfig(drain_s=DRAIN, **cfg))
    t0 = s.now
    s.set(2, mb=mb)
    s.run(5.0)
    assert s.gap(t0) == 0.0 and s.serving() == {1}
    reason = s.c.workloads["w"].reasons.get("switch", "")
    assert want in reason, reason
    view = s.c.switch_view("w")
    assert view is not None and view["serving_versions"] == [1] and view["reason"] == reason
    assert not s.c.assignments_of("w")  # nothing of v2 placed
    # room appears (a device joins): v2 is placed next to v1 after all
    s.devices.append(dev("big", 100 * MB))
    s.alive["big"], s.running["big"] = True, {}
    s.c.device_joined("big")
    s.run_until(lambda: s.settled(2, 1))
    assert s.gap(t0) == 0.0


def test_break_before_make_refuses_with_the_reason_then_serves_the_new_version() -> None:
    s = started(roomy(1, 45.0), 1)
    s.set(2)
    s.run_until(lambda: not s.c.chains("w"))
    reason = s.c.workloads["w"].reasons["switch"]
    assert "break-before-make" in reason and "refused" in reason
    r = Router("fog")
    (reply,) = r.submit(InferenceRequest("q", "w", "cli", {}, 1.0), s.c.chains("w"), s.now, 0.0, reason)
    assert isinstance(reply, ReplyClient) and "break-before-make" in reply.result.error
    s.run_until(lambda: s.settled(2, 1))


def test_remove_workload_during_a_switch_undeploys_every_version() -> None:
    s = started(roomy(), 1)
    s.set(2)
    s.step()
    assert s.c.assignments_of("w") and s.c.switches["w"].parts
    cmds = s.c.remove_workload("w")
    s.apply(cmds, drain=False)  # a deleted workload goes at once
    gone = {(u.device, u.version) for u in cmds if isinstance(u, UndeployPartition)}
    assert {v for _, v in gone} == {1, 2}
    assert "w" not in s.c.switches and s.c.chains("w") == [] and s.c.persisted_of("w") == []
    s.run(3.0)  # late loads of v2 arrive: orphans, undeployed after the grace
    s.run(4.0)
    assert not any(s.running[d] for d in s.running)


def test_switch_view_and_persisted_rows_follow_the_steps() -> None:
    s = started(roomy(), 1)
    s.set(2)
    view = s.c.switch_view("w")
    assert view is not None and view["from_version"] == 1 and view["to_version"] == 2
    assert view["serving_versions"] == [1] and {p["state"] for p in view["old_partitions"]} == {"serving"}
    assert {a.key[1] for a in s.persisted["w"]} == {1}  # stored with the switch: a restart adopts them
    s.run_until(lambda: s.serving() == {2})
    view = s.c.switch_view("w")
    assert view is not None and {p["state"] for p in view["old_partitions"]} == {"draining"}
    assert {a.key[1] for a in s.c.persisted_of("w")} == {1, 2}
    s.run_until(lambda: "w" not in s.c.switches)
    assert s.c.switch_view("w") is None and {a.key[1] for a in s.persisted["w"]} == {2}


def test_drain_is_a_deadline_of_the_core() -> None:
    s = started(roomy(), 1)
    s.set(2)
    s.run_until(lambda: s.serving() == {2})
    sw = s.c.switches["w"]
    due = min(sw.retire_at.values())
    assert due == pytest.approx(s.now + DRAIN, abs=DT + 1e-9) and s.c.next_deadline() <= due


def test_scheduler_sees_the_memory_old_partitions_hold() -> None:
    """v1 and v2 do not fit one device together: v2 goes to the other device, v1 is not disturbed."""
    s = started([SRC, dev("a", 45 * MB), dev("b", 45 * MB, )], 1)
    (v1_dev,) = {a.device for a in s.c.assignments_of("w")}
    s.set(2)
    s.run_until(lambda: s.settled(2, 1))
    assert {a.device for a in s.c.assignments_of("w")} == {"a", "b"} - {v1_dev}
    assert s.modes == {MAKE_BEFORE_BREAK}


# ------------------------------------------------------------------ the router across a retirement


def test_a_request_failing_on_a_retired_chain_fails_over_to_the_new_chain_with_the_same_replica() -> None:
    old = (0, (Hop("a", "w", 1, 0, 0),))
    new = (0, (Hop("b", "w", 2, 0, 0),))
    r = Router("fog")
    (send,) = r.submit(InferenceRequest("q", "w", "cli", {"x": np.zeros(1)}, 4.0), [old], 0.0, 0.0)
    assert isinstance(send, SendActivation) and send.device == "a"
    # v1 retired and undeployed before the request got through: its hop says so
    (again,) = r.result(InferenceResult(send.activation.request_id, False, error="no such partition",
                                        device_id="a"), [new], 0.5, 0.5, sender="a")
    assert isinstance(again, SendActivation) and again.device == "b"
