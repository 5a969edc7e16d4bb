"""Fleet registry core: table-driven transitions, epochs, deadlines, snapshots (no broker, no clock)."""
from __future__ import annotations

import pytest

from fog_broker.registry import (
    TRANSITIONS,
    DeviceJoined,
    DeviceLost,
    DeviceStatus,
    Registry,
    RegistryConfig,
    RequestRebirth,
)
from runtime.messages import DeviceBirth, DeviceDeath, DeviceState, PartitionStatus, Taint

KEY = bytes(32)


def birth(dev: str = "d1", epoch: int = 1, interval: float = 10.0, **kw: object) -> DeviceBirth:
    args = dict(device_id=dev, epoch=epoch, seq=1, site="s", public_key=KEY, flops=1e9, memory_bytes=1_000_000,
                uplink_bps=1e8, downlink_bps=1e8, rtt_s=0.001, power_active_w=5.0, power_idle_w=2.0,
                state_interval_s=interval)
    args.update(kw)
    return DeviceBirth(**args)  # type: ignore[arg-type]


def state(dev: str = "d1", epoch: int = 1, free: int = 900_000, **kw: object) -> DeviceState:
    return DeviceState(device_id=dev, epoch=epoch, seq=2, free_memory_bytes=free, **kw)  # type: ignore[arg-type]


def death(dev: str = "d1", epoch: int = 1) -> DeviceDeath:
    return DeviceDeath(dev, epoch)


def test_every_status_event_pair_is_in_the_table() -> None:
    for st in DeviceStatus:
        for ev in (DeviceBirth, DeviceState, DeviceDeath):
            assert (st, ev) in TRANSITIONS


@pytest.mark.parametrize("events, want_status, want_cmds", [
    ([birth()], DeviceStatus.LIVE, [DeviceJoined]),
    ([state()], DeviceStatus.UNKNOWN, [RequestRebirth]),
    ([death()], DeviceStatus.UNKNOWN, []),
    ([birth(), state()], DeviceStatus.LIVE, []),
    ([birth(), death()], DeviceStatus.DEAD, [DeviceLost]),
    ([birth(), death(), death()], DeviceStatus.DEAD, []),
    ([birth(), death(), state()], DeviceStatus.DEAD, [RequestRebirth]),
    ([birth(), death(), birth(epoch=2)], DeviceStatus.LIVE, [DeviceJoined]),
    # a late Will of the previous connection is ignored
    ([birth(epoch=1), birth(epoch=2), death(epoch=1)], DeviceStatus.LIVE, []),
    # a stale state of the old connection is ignored
    ([birth(epoch=2), state(epoch=1)], DeviceStatus.LIVE, []),
    # a state from a newer connection whose birth we missed: ask for a rebirth
    ([birth(epoch=1), state(epoch=2)], DeviceStatus.LIVE, [RequestRebirth]),
])
def test_transitions(events: list, want_status: DeviceStatus, want_cmds: list) -> None:
    reg = Registry()
    cmds: list = []
    for i, ev in enumerate(events):
        cmds = reg.handle(ev, float(i))
    assert reg.get("d1").status is want_status  # type: ignore[union-attr]
    assert [type(c) for c in cmds] == want_cmds


def test_stale_adverts_are_counted() -> None:
    reg = Registry()
    reg.handle(birth(epoch=3), 0.0)
    reg.handle(death(epoch=2), 1.0)
    reg.handle(state(epoch=1), 1.0)
    assert reg.stale == 2
    assert reg.get("d1").status is DeviceStatus.LIVE  # type: ignore[union-attr]


def test_deadline_suspect_then_dead_after_three_intervals() -> None:
    reg = Registry(RegistryConfig(missed_intervals=3, suspect_intervals=1.5))
    reg.handle(birth(interval=2.0), 0.0)
    assert reg.tick(2.9) == []
    assert reg.get("d1").status is DeviceStatus.LIVE  # type: ignore[union-attr]
    assert reg.tick(3.1) == []
    assert reg.get("d1").status is DeviceStatus.SUSPECT  # type: ignore[union-attr]
    assert reg.next_deadline() == pytest.approx(6.0)
    reg.handle(state(), 4.0)  # a state brings it back
    assert reg.get("d1").status is DeviceStatus.LIVE  # type: ignore[union-attr]
    assert reg.tick(9.9) == []
    cmds = reg.tick(10.1)
    assert [type(c) for c in cmds] == [DeviceLost]
    assert cmds[0].reason == "missed state adverts"  # type: ignore[union-attr]
    assert reg.tick(20.0) == []  # reported once


def test_a_pause_of_the_observer_moves_the_deadlines_by_its_length() -> None:
    """The fog's own stall is not the devices' silence: a 4 s pause credited before the tick keeps
    a device whose adverts the stalled fog could not read; it is lost that much later, not never."""
    reg = Registry(RegistryConfig(missed_intervals=3, suspect_intervals=1.5))
    reg.handle(birth(interval=1.0), 0.0)
    reg.credit_pause(4.0)
    assert reg.tick(4.5) == []
    assert reg.get("d1").status is DeviceStatus.LIVE  # type: ignore[union-attr]
    assert reg.next_deadline() == pytest.approx(5.5)
    reg.credit_pause(float("nan"))  # ignored, as a negative or zero pause is
    reg.credit_pause(-1.0)
    assert [type(c) for c in reg.tick(7.1)] == [DeviceLost]
    dead_at = reg.get("d1").last_seen  # type: ignore[union-attr]
    reg.credit_pause(10.0)  # a device already lost stays lost, its record untouched
    assert reg.get("d1").last_seen == dead_at  # type: ignore[union-attr]


def test_without_the_credit_the_same_pause_loses_the_device() -> None:
    reg = Registry(RegistryConfig(missed_intervals=3, suspect_intervals=1.5))
    reg.handle(birth(interval=1.0), 0.0)
    assert [type(c) for c in reg.tick(4.5)] == [DeviceLost]


def test_rebirth_requests_are_rate_limited() -> None:
    reg = Registry(RegistryConfig(rebirth_backoff_s=2.0))
    assert [type(c) for c in reg.handle(state(), 0.0)] == [RequestRebirth]
    assert reg.handle(state(), 1.0) == []
    assert [type(c) for c in reg.handle(state(), 2.5)] == [RequestRebirth]


def test_state_before_birth_is_kept_for_the_same_connection() -> None:
    """After a fog restart a device's state may arrive before its (requested) birth."""
    reg = Registry()
    part = PartitionStatus("w", 1, 0, 0, "a" * 64, "running")
    reg.handle(state(partitions=(part,)), 0.0)
    reg.handle(birth(), 0.5)
    assert reg.reported() == {"d1": (part,)}


def test_fleet_snapshot_uses_birth_resources_and_latest_state() -> None:
    reg = Registry()
    reg.handle(birth("a", labels={"power-domain": "p1"}, taints=(Taint("gpu", "yes"),),
                     battery_capacity_wh=10.0), 0.0)
    reg.handle(state("a", free=400_000, battery_level=0.5, charging=True), 0.1)
    reg.handle(birth("b"), 0.0)
    reg.handle(death("b"), 0.2)
    fleet = reg.fleet(reserved={"a": 100_000})
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    assert a.memory_bytes == 500_000  # reported free + what our partitions already hold
    assert a.label_map == {"power-domain": "p1"}
    assert a.taints[0].key == "gpu"
    assert a.battery is not None and a.battery.level == 0.5 and a.battery.charging
    assert a.alive and not b.alive
    assert b.memory_bytes == 1_000_000


@pytest.mark.parametrize("kw, fit, phrase", [
    (dict(), True, "mains powered"),
    (dict(battery_level=0.9), True, "battery"),
    (dict(battery_level=0.1), False, "below floor"),
    (dict(battery_level=0.1, charging=True), True, "charging"),
    (dict(throttled=True), False, "throttled"),
    (dict(metered=True), False, "metered"),
])
def test_training_fitness_in_summaries(kw: dict, fit: bool, phrase: str) -> None:
    reg = Registry(RegistryConfig(battery_floor=0.3))
    reg.handle(birth(), 0.0)
    reg.handle(state(**kw), 0.1)
    (s,) = reg.summaries()
    assert s.fit_for_training is fit
    assert phrase in s.reason


def test_dead_device_is_not_fit() -> None:
    reg = Registry()
    reg.handle(birth(), 0.0)
    reg.handle(state(), 0.1)
    reg.handle(death(), 0.2)
    (s,) = reg.summaries()
    assert not s.alive and not s.fit_for_training
