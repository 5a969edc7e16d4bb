"""Pure cores: advertiser policy, deploy verdicts, stats, label/taint parsing, profiles, simulation."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_agent.advertiser import Advertiser, AdvertPolicy, Snapshot, build_birth, change_reason
from edge_agent.commands import (
    ARTIFACT_TOO_LARGE,
    BAD_ARTIFACT_SIGNATURE,
    HASH_MISMATCH,
    INSUFFICIENT_MEMORY,
    METADATA_MISMATCH,
    NO_ARTIFACT,
    NO_FOG_KEY,
    check_deploy,
    parse_labels,
    parse_taints,
)
from edge_agent.readings import Capabilities, Reading
from edge_agent.simulated import SimulatedDevice
from edge_agent.stats import LatencyWindow, LinkEstimator, percentile
from edge_agent.testing import FogSigner
from runtime import codec
from runtime.errors import RemoteViolation
from runtime.messages import Deploy, PartitionStatus, Taint
from runtime.security import Identity
from simulations.profiles import PROFILES, DeviceProfile, get_profile

GB = 1_000_000_000


def snap(free: int = 4 * GB, battery: float | None = None, throttled: bool = False,
         parts: tuple[PartitionStatus, ...] = (), charging: bool = False) -> Snapshot:
    return Snapshot(Reading(free_memory_bytes=free, battery_level=battery, throttled=throttled, charging=charging),
                    parts)


PART = PartitionStatus("wl", 1, 0, 0, "a" * 64, "running")


@pytest.mark.parametrize("name, prev, cur, reason", [
    ("same", snap(), snap(), None),
    ("memory -9%", snap(), snap(free=int(4 * GB * 0.91)), None),
    ("memory -10%", snap(), snap(free=int(4 * GB * 0.90)), "free memory changed"),
    ("memory +10%", snap(), snap(free=int(4 * GB * 1.10)), "free memory changed"),
    ("battery -4 points", snap(battery=0.80), snap(battery=0.76), None),
    ("battery -5 points", snap(battery=0.80), snap(battery=0.75), "battery dropped"),
    ("battery rises", snap(battery=0.50), snap(battery=0.60), None),
    ("unplugged", snap(battery=None), snap(battery=0.9), "power source changed"),
    ("charger", snap(battery=0.5), snap(battery=0.5, charging=True), "charging changed"),
    ("throttling starts", snap(), snap(throttled=True), "throttling changed"),
    ("throttling stops", snap(throttled=True), snap(), "throttling changed"),
    ("partition added", snap(), snap(parts=(PART,)), "partitions changed"),
    ("partition health", snap(parts=(PART,)),
     snap(parts=(PartitionStatus("wl", 1, 0, 0, "a" * 64, "failed"),)), "partitions changed"),
    ("latency only", snap(parts=(PART,)),
     snap(parts=(PartitionStatus("wl", 1, 0, 0, "a" * 64, "running", 0.1, 0.2, 5),)), None),
])
def test_change_reason(name: str, prev: Snapshot, cur: Snapshot, reason: str | None) -> None:
    assert change_reason(prev, cur, AdvertPolicy()) == reason


def test_advertiser_interval_and_changes() -> None:
    adv = Advertiser("d1", AdvertPolicy(state_interval_s=10))
    assert adv.tick(snap(), 0.0) == "first"
    assert adv.tick(snap(), 5.0) is None
    assert adv.next_due(5.0) == 10.0
    assert adv.tick(snap(throttled=True), 6.0) == "throttling changed"
    assert adv.tick(snap(throttled=True), 15.9) is None
    assert adv.tick(snap(throttled=True), 16.0) == "interval"
    adv.reset()
    assert adv.tick(snap(throttled=True), 16.5) == "first"
    assert adv.sent == 4


def test_advertiser_builds_valid_messages() -> None:
    adv = Advertiser("d1")
    state = adv.state(snap(battery=0.5, parts=(PART,)), epoch=3, seq=7)
    assert codec.decode(codec.encode(state)) == state
    caps = Capabilities(1e9, GB, 1e8, 1e8, 0.002, 5.0, 2.0, labels={"arch": "arm64", "zone": "x"})
    birth = build_birth("d1", "s1", caps, b"k" * 32, epoch=3, seq=1, labels={"zone": "y"},
                        taints=(Taint("gpu", "", "NoSchedule"),), state_interval_s=10.0)
    assert birth.labels == {"arch": "arm64", "zone": "y", "site": "s1"}
    assert codec.decode(codec.encode(birth)) == birth


# ---------------------------------------------------------------- deploy verdicts

FOG = FogSigner("fog-1")
ART = b"not really onnx, but signed bytes" * 10


def _deploy(**kw: object) -> Deploy:
    return FOG.deploy("c1", ART, workload="wl", version=2, replica=1, index=0, memory_bytes=1000)


def _with(d: Deploy, **changes: object) -> Deploy:
    return dataclasses.replace(d, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("name, make, artifact, key, free, reason", [
    ("ok", lambda: _deploy(), ART, FOG.public_key, 10_000, ""),
    ("no key", lambda: _deploy(), ART, None, 10_000, NO_FOG_KEY),
    ("no artifact", lambda: _deploy(), None, FOG.public_key, 10_000, NO_ARTIFACT),
    ("tampered bytes", lambda: _deploy(), ART + b"x", FOG.public_key, 10_000, HASH_MISMATCH),
    ("wrong signer key", lambda: _deploy(), ART, Identity.generate("evil").public_key_bytes, 10_000,
     BAD_ARTIFACT_SIGNATURE),
    ("signed by someone else", lambda: FOG.deploy("c1", ART, signer=Identity.generate("fog-1")), ART,
     FOG.public_key, 10_000, BAD_ARTIFACT_SIGNATURE),
    ("metadata swapped", lambda: _with(_deploy(), index=1), ART, FOG.public_key, 10_000, METADATA_MISMATCH),
    ("metadata edited", lambda: _with(_deploy(), index=1, metadata={"workload": "wl", "version": "2",
                                                                     "replica": "1", "index": "1"}),
     ART, FOG.public_key, 10_000, BAD_ARTIFACT_SIGNATURE),
    ("does not fit", lambda: _deploy(), ART, FOG.public_key, 999, INSUFFICIENT_MEMORY),
], ids=lambda v: v if isinstance(v, str) else "")
def test_check_deploy(name: str, make, artifact: bytes | None, key: bytes | None, free: int, reason: str) -> None:
    v = check_deploy(make(), artifact, fog_key=key, free_memory_bytes=free, max_artifact_bytes=1 << 20)
    assert v.ok == (reason == "") and v.reason == reason, v.message


def test_check_deploy_too_large() -> None:
    v = check_deploy(_deploy(), ART, fog_key=FOG.public_key, free_memory_bytes=10**9, max_artifact_bytes=10)
    assert v.reason == ARTIFACT_TOO_LARGE


def test_parse_labels_and_taints() -> None:
    assert parse_labels("zone=a, power-domain=pd1,") == {"zone": "a", "power-domain": "pd1"}
    assert parse_labels(None) == {}
    with pytest.raises(ValueError):
        parse_labels("novalue")
    assert parse_taints("gpu=true:NoSchedule,battery:PreferNoSchedule,x=1") == (
        Taint("gpu", "true", "NoSchedule"), Taint("battery", "", "PreferNoSchedule"), Taint("x", "1", "NoSchedule"))
    with pytest.raises(RemoteViolation):
        parse_taints("gpu=true:Sometimes")


# ---------------------------------------------------------------- stats


def test_percentiles_and_window() -> None:
    assert percentile([], 50) == 0.0
    w = LatencyWindow(size=100)
    for i in range(1, 201):
        w.add(i / 1000)
    w.add(float("nan"))
    assert len(w) == 100
    assert w.p(50) == pytest.approx(0.150)
    assert w.p(99) == pytest.approx(0.199)


def test_link_estimator_20mbit() -> None:
    est = LinkEstimator()
    assert est.uplink_bps is None and est.rtt_s is None
    rng = np.random.default_rng(1)
    for _ in range(10):
        est.observe(300, 0.004 + rng.uniform(0, 0.001))         # small acks: ~4.5 ms RTT
    for _ in range(10):
        nbytes = 500_000
        est.observe(nbytes, 0.0045 + nbytes * 8 / 20e6 * rng.uniform(1.0, 1.08))
    assert est.rtt_s == pytest.approx(0.0045, abs=0.001)
    assert 18e6 < est.uplink_bps < 20.5e6
    est.observe(500_000, 30.0)  # one stalled ack barely moves a median
    assert est.uplink_bps > 18e6


# ---------------------------------------------------------------- profiles and simulated devices


def test_profiles_complete() -> None:
    assert set(PROFILES) >= {"pi4", "pi5", "orin-nano", "jetson-nano", "x86-gateway", "camera", "laptop"}
    for name, p in PROFILES.items():
        assert p.name == name and p.flops > 0 and p.memory_bytes > 0 and p.power_active_w >= p.power_idle_w
        dev = p.to_fleet_device(f"{name}-1")
        assert dev["battery"] is None or dev["battery"]["capacity_wh"] > 0
        assert {"arch", "accelerator"} <= set(dev["labels"])
        hash(p)
    assert PROFILES["laptop"].battery_powered and not PROFILES["pi4"].battery_powered
    with pytest.raises(KeyError, match="known"):
        get_profile("toaster")
    with pytest.raises(ValueError):
        DeviceProfile("bad", flops=0, memory_bytes=1, uplink_bps=1, downlink_bps=1, rtt_s=0,
                      power_active_w=1, power_idle_w=1)


def test_simulated_battery_drains_faster_while_computing() -> None:
    idle = SimulatedDevice(PROFILES["camera"], speedup=100.0)
    busy = SimulatedDevice(PROFILES["camera"], speedup=100.0)
    idle.read(0.0, 0.0)
    busy.read(0.0, 0.0)
    r_idle = idle.read(60.0, 0.0)
    r_busy = busy.read(60.0, 60.0)
    assert r_busy.battery_level < r_idle.battery_level < 1.0
    # camera: 1.2 W idle for 60 s x100 = 7200 J = 2 Wh of 20 Wh -> 10 points
    assert r_idle.battery_level == pytest.approx(0.9, abs=1e-3)
    assert r_busy.power_w == pytest.approx(PROFILES["camera"].power_active_w)
    mains = SimulatedDevice(PROFILES["pi4"], battery_level=None)
    mains.reserved = lambda: GB
    assert mains.read(1.0).battery_level is None
    assert mains.read(2.0).free_memory_bytes == PROFILES["pi4"].memory_bytes - GB
    assert mains.capabilities().simulated
