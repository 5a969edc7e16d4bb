"""A device that reports thermal throttling takes no partition, and what it runs is re-placed.

Pure: the registry reports the change, the scheduler's ``NotThrottled`` filter refuses the device
(per device and in its vectorised mask) and invalidates a placement on it; ``SiteCore`` plans again
at once, so the running stage moves to another device. Unthrottled, the device is usable again.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fog_broker.controller import DeployPartition, UndeployPartition
from fog_broker.placement.model import ChainProfile, Segment, Workload
from fog_broker.placement.plugins import THROTTLED, NodeView, NotThrottled
from fog_broker.placement.scheduler import schedule
from fog_broker.registry import Registry, ThrottleChanged
from fog_broker.site_core import Ack, Advert, SetWorkload, SiteCore, SiteCoreConfig, SiteEvent
from runtime.messages import DeviceBirth, DeviceState, PartitionStatus

MB = 1_000_000
#: ``src`` holds nothing; ``a`` is faster than ``b``, so every objective prefers it
HARDWARE = {"src": (1e6, 1), "a": (2e10, 100 * MB), "b": (1e10, 100 * MB)}


def birth(dev: str) -> DeviceBirth:
    flops, mem = HARDWARE[dev]
    return DeviceBirth(device_id=dev, epoch=1, seq=1, site="s", public_key=bytes(32), flops=flops,
                       memory_bytes=mem, uplink_bps=1e8, downlink_bps=1e8, rtt_s=1e-3,
                       power_active_w=5.0, power_idle_w=1.0, tx_j_per_byte=1e-8,
                       rx_j_per_byte=1e-8, state_interval_s=1.0)


def state(dev: str, seq: int = 2, throttled: bool = False,
          parts: tuple[PartitionStatus, ...] = ()) -> DeviceState:
    return DeviceState(device_id=dev, epoch=1, seq=seq, free_memory_bytes=HARDWARE[dev][1],
                       throttled=throttled, partitions=parts)


def workload() -> Workload:
    prof = ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e9, 1 * MB, 1 * MB, 1000.0)
                                           for i in range(2)))
    return Workload(name="w", source="src", sink="src", profile=prof)


def site() -> Registry:
    reg = Registry()
    for did in HARDWARE:
        reg.handle(birth(did), 0.0)
        reg.handle(state(did), 0.5)
    return reg


def hosts(res: object) -> set[str]:
    return {p.device for p in res.replicas[0].partitions}  # type: ignore[attr-defined]


def test_registry_reports_throttling_changes_once() -> None:
    reg = site()
    assert reg.handle(state("a", 3, throttled=True), 1.0) == [ThrottleChanged("a", True)]
    assert reg.handle(state("a", 4, throttled=True), 2.0) == []  # still throttled: nothing new
    assert {d.id: d for d in reg.fleet().devices}["a"].throttled
    assert reg.handle(state("a", 5), 3.0) == [ThrottleChanged("a", False)]
    assert not {d.id: d for d in reg.fleet().devices}["a"].throttled


def test_filter_and_mask_agree() -> None:
    reg = site()
    reg.handle(state("a", 3, throttled=True), 1.0)
    devs = reg.fleet().devices
    plugin = NotThrottled()
    per_device = [plugin.filter(workload(), NodeView(d, d.memory_bytes)).ok for d in devs]
    fl = reg.fleet()
    batch = plugin.batch(workload(), fl, np.array([d.memory_bytes for d in fl.devices]))
    assert per_device == list(batch) == [d.id != "a" for d in devs]
    bad = plugin.filter(workload(), NodeView(next(d for d in devs if d.id == "a"), 1e9))
    assert bad.reasons == (THROTTLED,)


def test_throttled_device_loses_its_stage_and_is_usable_again() -> None:
    reg = site()
    first = schedule(reg.fleet(), [workload()]).result("w")
    assert first.placed and hosts(first) == {"a"}
    reg.handle(state("a", 3, throttled=True), 1.0)
    moved = schedule(reg.fleet(), [workload()], current={"w": first.placement}).result("w")
    assert moved.placed and not moved.kept and hosts(moved) == {"b"}
    reg.handle(state("a", 4), 2.0)
    again = schedule(reg.fleet(), [workload()]).result("w")
    assert hosts(again) == {"a"}  # no longer throttled: it takes work again


def test_no_other_device_leaves_the_workload_pending_with_the_reason() -> None:
    reg = site()
    for did in ("a", "b"):
        reg.handle(state(did, 3, throttled=True), 1.0)
    res = schedule(reg.fleet(), [workload()]).result("w")
    assert not res.placed
    reasons = dict(res.reasons)
    assert "2 devices report thermal throttling" in reasons["throttled"], reasons
    assert dict(res.detail)["histogram"].get(THROTTLED) == 2


def test_site_moves_the_running_stage_off_a_device_that_starts_throttling() -> None:
    core = SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0))
    now = 0.0
    running: dict[str, dict[tuple[str, int, int, int], PartitionStatus]] = {d: {} for d in HARDWARE}
    seq = dict.fromkeys(HARDWARE, 1)
    throttled = dict.fromkeys(HARDWARE, False)
    events: list[SiteEvent] = []

    def carry(cmds: Sequence[object]) -> None:
        """The devices: deploy and ack at once, undeploy when told."""
        queue = list(cmds)
        while queue:
            c = queue.pop(0)
            if isinstance(c, SiteEvent):
                events.append(c)
            elif isinstance(c, DeployPartition):
                key = (c.workload, c.version, c.replica, c.index)
                running[c.device][key] = PartitionStatus(*key, sha256="0" * 64, health="running")
                queue += core.handle(Ack(c.device, c.command_id, True, ""), now)
            elif isinstance(c, UndeployPartition):
                running[c.device].pop((c.workload, c.version, c.replica, c.index), None)

    def advertise() -> None:
        for d in HARDWARE:
            seq[d] += 1
            msg = state(d, seq[d], throttled[d], tuple(running[d].values()))
            carry(core.handle(Advert(msg), now))

    for d in HARDWARE:
        carry(core.handle(Advert(birth(d)), now))
    advertise()
    carry(core.handle(SetWorkload(workload(), 1), now))
    deadline = 30.0
    while now < deadline and not running["a"]:
        now += 0.5
        carry(core.tick(now, 1e9 + now))
        advertise()
    assert running["a"] and not running["b"], running

    throttled["a"] = True
    start = now
    while now < start + deadline and (running["a"] or not running["b"]):
        now += 0.5
        advertise()
        carry(core.tick(now, 1e9 + now))
    assert running["b"] and not running["a"], running
    assert any(e.kind == "device throttled" and e.device == "a" for e in events)
    assert all(a.device != "a" for a in core.controller.assignments.values()
               if a.key[0] == "w" and a.phase.value in ("deploying", "running"))

    throttled["a"] = False
    now += 0.5
    advertise()
    assert any(e.kind == "device unthrottled" and e.device == "a" for e in events)
    fleet = core.registry.fleet()
    assert not {d.id: d for d in fleet.devices}["a"].throttled
