"""The registry's incremental views equal a from-scratch rebuild after any event sequence."""
from __future__ import annotations

import math
import random
from collections.abc import Mapping

import pytest

from fog_broker.placement.model import Device, Fleet, Taint
from fog_broker.registry import Registry, RegistryConfig
from runtime.messages import DeviceBirth, DeviceDeath, DeviceState, PartitionStatus
from runtime.messages import Taint as MsgTaint

KEY = bytes(32)
IDS = [f"d{i}" for i in range(8)]


def _positive(v: float) -> float:
    return v if v > 0 and math.isfinite(v) else 1.0


def reference_fleet(reg: Registry, reserved: Mapping[str, float] | None = None) -> Fleet:
    """The non-incremental ``Registry.fleet`` as it was before the cache (kept verbatim)."""
    reserved = reserved or {}
    devices = []
    for did in sorted(reg.devices):
        rec = reg.devices[did]
        b = rec.birth
        if b is None:
            continue
        st = rec.state if rec.state is not None and rec.state.epoch == rec.epoch else None
        mem = float(b.memory_bytes)
        if st is not None:
            mem = min(mem, float(st.free_memory_bytes) + float(reserved.get(did, 0.0)))
        level = st.battery_level if st is not None and st.battery_level is not None else 1.0
        uplink = st.uplink_bps if st is not None and st.uplink_bps else b.uplink_bps
        rtt = st.rtt_s if st is not None and st.rtt_s is not None else b.rtt_s
        devices.append(Device(
            id=did, flops=_positive(b.flops), memory_bytes=max(mem, 0.0),
            uplink_bps=_positive(uplink), downlink_bps=_positive(b.downlink_bps),
            rtt_s=rtt, power_active_w=b.power_active_w, power_idle_w=b.power_idle_w,
            tx_j_per_byte=b.tx_j_per_byte, rx_j_per_byte=b.rx_j_per_byte,
            labels=tuple(sorted(b.labels.items())),
            taints=tuple(Taint(t.key, t.value, t.effect) for t in b.taints),
            battery_capacity_wh=b.battery_capacity_wh, battery_level=min(max(level, 0.0), 1.0),
            charging=bool(st.charging) if st is not None else False, alive=rec.alive,
            measured=rec.measured_flops is not None,
        ))
    return Fleet(tuple(devices))


def reference_reported(reg: Registry) -> list[tuple[str, tuple[PartitionStatus, ...]]]:
    return [(d, r.partitions()) for d, r in reg.devices.items()
            if r.alive and r.state is not None and r.state.epoch == r.epoch]


def _birth(rng: random.Random, dev: str, epoch: int) -> DeviceBirth:
    return DeviceBirth(
        device_id=dev, epoch=epoch, seq=1, site="s", public_key=KEY, flops=rng.choice([1e9, 2e9]),
        memory_bytes=rng.choice([1_000_000, 2_000_000]), uplink_bps=1e8, downlink_bps=1e8, rtt_s=0.001,
        power_active_w=5.0, power_idle_w=2.0, state_interval_s=rng.choice([0.0, 2.0, 10.0]),
        battery_capacity_wh=rng.choice([None, 10.0]),
        labels={"power-domain": rng.choice(["p1", "p2"])},
        taints=rng.choice([(), (MsgTaint("gpu", "yes"),)]))


def _state(rng: random.Random, dev: str, epoch: int) -> DeviceState:
    parts = tuple(PartitionStatus("w", 1, r, 0, "a" * 64, rng.choice(["running", "loading"]))
                  for r in range(rng.randint(0, 2)))
    return DeviceState(
        device_id=dev, epoch=epoch, seq=rng.randint(2, 99), free_memory_bytes=rng.choice([0, 300_000, 900_000]),
        battery_level=rng.choice([None, 0.0, 0.4, 1.0]), charging=rng.random() < 0.3,
        uplink_bps=rng.choice([None, 0.0, 5e7]), rtt_s=rng.choice([None, 0.02]), partitions=parts)


@pytest.mark.parametrize("seed", range(12))
def test_incremental_views_equal_a_rebuild_after_random_events(seed: int) -> None:
    rng = random.Random(seed)
    reg = Registry(RegistryConfig(default_interval_s=2.0))
    epochs = dict.fromkeys(IDS, 1)
    last_state: dict[str, DeviceState] = {}
    now = 0.0
    for _ in range(400):
        now += rng.choice([0.0, 0.5, 1.0, 4.0])
        dev = rng.choice(IDS)
        r = rng.random()
        ep = max(0, epochs[dev] + rng.choice([-1, 0, 0, 0, 1]))
        if r < 0.15:
            epochs[dev] = max(epochs[dev], ep)
            reg.handle(_birth(rng, dev, ep), now)
        elif r < 0.5:
            st = _state(rng, dev, ep)
            last_state[dev] = st
            reg.handle(st, now)
        elif r < 0.6 and dev in last_state:
            reg.handle(last_state[dev], now)  # the same object again (the simulator's cached adverts)
        elif r < 0.7:
            reg.handle(DeviceDeath(dev, ep), now)
        elif r < 0.8:
            reg.tick(now)
        elif r < 0.83:
            reg.forget(dev)
        elif r < 0.86:
            reg.ask_rebirth(dev, now, "not enrolled")
        reserved = {d: float(rng.choice([0, 100_000, 500_000])) for d in rng.sample(IDS, rng.randint(0, 4))}
        if rng.random() < 0.7:
            got = reg.fleet(reserved)
            assert got == reference_fleet(reg, reserved)
            assert got.devices == reference_fleet(reg, reserved).devices
            assert reg.fleet(reserved) is got  # nothing changed: the same snapshot (and its cache)
        if rng.random() < 0.7:
            assert list(reg.reported().items()) == reference_reported(reg)  # order included


def test_fleet_is_rebuilt_when_only_reserved_memory_changes() -> None:
    rng = random.Random(1)
    reg = Registry()
    reg.handle(_birth(rng, "a", 1), 0.0)
    reg.handle(DeviceState("a", 1, 2, free_memory_bytes=400_000), 0.1)
    first = reg.fleet({"a": 100_000})
    assert first.devices[0].memory_bytes == 500_000
    second = reg.fleet({})
    assert second is not first and second.devices[0].memory_bytes == 400_000
    assert reg.fleet() is second


def test_reported_returns_a_fresh_dict() -> None:
    rng = random.Random(2)
    reg = Registry()
    reg.handle(_birth(rng, "a", 1), 0.0)
    reg.handle(DeviceState("a", 1, 2, free_memory_bytes=1), 0.1)
    got = reg.reported()
    got.clear()  # a caller's edit must not reach the cache
    assert list(reg.reported()) == ["a"]


def test_invalidate_after_editing_records_by_hand() -> None:
    rng = random.Random(3)
    reg = Registry()
    reg.handle(_birth(rng, "a", 1), 0.0)
    reg.handle(_birth(rng, "b", 1), 0.0)
    reg.fleet()
    reg.devices["a"].birth = None
    reg.invalidate()
    assert [d.id for d in reg.fleet().devices] == ["b"] and reg.reported() == {}
    reg.invalidate()  # a full rebuild of unchanged records gives an equal snapshot
    assert reg.fleet() == reference_fleet(reg)
