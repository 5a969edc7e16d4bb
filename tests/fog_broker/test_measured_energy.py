"""Measured joules in placement: a device whose rails measured its partitions' energy is planned
with that active power (joules per inference over seconds per inference), not its declared one.

Pure: registry and scheduler, no broker, no clock.
"""
from __future__ import annotations

import pytest

from fog_broker.placement.model import ChainProfile, Segment, Workload
from fog_broker.placement.scheduler import schedule
from fog_broker.registry import Registry, measured_power
from runtime.messages import DeviceBirth, DeviceState, PartitionStatus

MB = 1_000_000


def birth(dev: str, flops: float = 1e10, memory: int = 100 * MB, power: float = 5.0) -> DeviceBirth:
    return DeviceBirth(device_id=dev, epoch=1, seq=1, site="s", public_key=bytes(32), flops=flops,
                       memory_bytes=memory, uplink_bps=1e8, downlink_bps=1e8, rtt_s=1e-3,
                       power_active_w=power, power_idle_w=1.0, tx_j_per_byte=1e-8,
                       rx_j_per_byte=1e-8, state_interval_s=10.0)


def part(calib_s: float, joules: float, measured: bool = True) -> PartitionStatus:
    return PartitionStatus("other", 1, 0, 0, sha256="0" * 64, health="running", calib_s=calib_s,
                           joules_per_inference=joules, energy_measured=measured)


def state(dev: str, *parts: PartitionStatus, memory: int = 100 * MB) -> DeviceState:
    return DeviceState(device_id=dev, epoch=1, seq=2, free_memory_bytes=memory, partitions=parts)


def workload(objective: str) -> Workload:
    prof = ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e9, 1 * MB, 1 * MB, 1000.0)
                                           for i in range(3)))
    return Workload(name="w", source="src", sink="src", profile=prof, objective=objective)


def site() -> Registry:
    """``src`` can hold nothing; ``a`` is a little faster than ``b``, both declare 5 W."""
    reg = Registry()
    for did, flops, mem in (("src", 1e6, 1), ("a", 1.2e10, 100 * MB), ("b", 1e10, 100 * MB)):
        reg.handle(birth(did, flops=flops, memory=mem), 0.0)
        reg.handle(state(did, memory=mem), 0.5)
    return reg


def hosts(reg: Registry, objective: str) -> set[str]:
    res = schedule(reg.fleet(), [workload(objective)]).result("w")
    assert res.placed, res.reasons
    return {p.device for p in res.replicas[0].partitions}


def test_measured_power_is_joules_over_seconds_and_only_when_measured() -> None:
    assert measured_power(state("a", part(0.01, 0.5))) == pytest.approx(50.0)
    assert measured_power(state("a", part(0.01, 0.5, measured=False))) is None  # modelled: no
    assert measured_power(state("a", part(0.0, 0.5))) is None  # no calibration: no
    assert measured_power(state("a", part(0.01, 0.0))) is None
    assert measured_power(state("a", part(0.01, 0.1), part(0.02, 0.6))) == pytest.approx(30.0)
    assert measured_power(state("a", part(1e-6, 1e3))) is None  # 1 GW is no measurement


def test_energy_objective_follows_measured_joules_latency_does_not() -> None:
    reg = site()
    assert hosts(reg, "energy") == {"a"} and hosts(reg, "latency") == {"a"}
    # a's rails: 0.5 J per 10 ms inference -> 50 W, ten times its declared 5 W
    reg.handle(state("a", part(0.01, 0.5)), 1.0)
    fleet = reg.fleet()
    devs = {d.id: d for d in fleet.devices}
    assert devs["a"].power_active_w == pytest.approx(50.0)
    assert devs["b"].power_active_w == 5.0  # never measured: keeps its declared figure
    assert reg.get("a").measured_power_w == pytest.approx(50.0)  # type: ignore[union-attr]
    assert hosts(reg, "energy") == {"b"}
    assert hosts(reg, "latency") == {"a"}


def test_latest_measurement_wins_and_a_modelled_figure_changes_nothing() -> None:
    reg = site()
    reg.handle(state("a", part(0.01, 0.5)), 1.0)
    reg.handle(state("a", part(0.01, 0.5, measured=False)), 2.0)  # modelled: keeps the measurement
    assert {d.id: d for d in reg.fleet().devices}["a"].power_active_w == pytest.approx(50.0)
    reg.handle(state("a", part(0.01, 0.02)), 3.0)  # measured again: 2 W, now the cheaper device
    assert {d.id: d for d in reg.fleet().devices}["a"].power_active_w == pytest.approx(2.0)
    assert hosts(reg, "energy") == {"a"}
