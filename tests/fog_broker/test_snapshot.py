"""The site core's read side (issue 31): a frozen snapshot, rebuilt only when the core moved, and
the release rule the fog and the simulations share."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from fog_broker.placement.model import ChainProfile, Segment, Workload
from fog_broker.placement.scheduler import schedule
from fog_broker.site_core import (
    AdvertRejected,
    FollowRelease,
    ReleaseAccepted,
    RemoveWorkload,
    Restore,
    SetWorkload,
    SiteCore,
    SiteCoreConfig,
    SiteEvent,
)

MB = 1 << 20


def workload(name: str = "w", model: str = "file:aa") -> Workload:
    prof = ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e9, MB, MB, 1000.0) for i in range(2)))
    return Workload(name=name, source="src", sink="src", profile=prof, model=model)


def core() -> SiteCore:
    return SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0))


def test_the_snapshot_is_frozen_and_says_why_a_workload_does_not_serve() -> None:
    c = core()
    c.handle(SetWorkload(workload(), 1), 0.0)
    c.tick(1.0, 1e9)  # plans: no device, so it pends with the scheduler's reasons
    snap = c.snapshot(1.0)
    row = snap.workload("w")
    assert row is not None and row.status == "pending" and not row.ready and row.reasons
    assert row.why_not_ready() == "; ".join(f"{k}: {v}" for k, v in row.reasons)
    assert row.doc["name"] == "w" and row.doc["reasons"] == dict(row.reasons)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.ready = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        row.doc["status"] = "running"  # type: ignore[index]
    assert isinstance(row.doc["placement"], tuple) and snap.counters["reconciles"] >= 1


def test_the_snapshot_is_rebuilt_only_after_the_core_moved() -> None:
    c = core()
    first = c.snapshot(0.0)
    assert c.snapshot(0.1) is first  # nothing happened since
    c.handle(SetWorkload(workload(), 1), 0.2)
    second = c.snapshot(0.2)
    assert second is not first and second.workload("w") is not None and first.workload("w") is None
    c.handle(RemoveWorkload("w"), 0.3)
    assert c.snapshot(0.35, max_age_s=1.0) is second  # a reader that allows 1 s of age keeps it
    assert c.snapshot(0.4).workload("w") is None


def test_a_rejected_advert_carries_its_field_and_value() -> None:
    c = core()
    ev = AdvertRejected("dev-x", "DeviceBirth.rtt_s", "-1.0")
    out = c.handle(ev, 0.0)
    assert SiteEvent("advert rejected", "dev-x", "DeviceBirth.rtt_s=-1.0") in out


def test_a_newer_release_switches_its_followers_and_an_older_one_changes_nothing() -> None:
    c = core()
    c.handle(SetWorkload(workload("a", "file:v1"), 1, "release:det"), 0.0)
    c.handle(SetWorkload(workload("b", "file:v1"), 1, "release:det"), 0.0)
    c.handle(SetWorkload(workload("c", "zoo:tiny"), 1, "zoo:tiny"), 0.0)
    assert c.handle(ReleaseAccepted("det", 2, "file:v2", "coord"), 1.0) == [
        FollowRelease("det", 2, "file:v2", ("a", "b"))]
    assert c.handle(ReleaseAccepted("det", 2, "file:v2b", "coord"), 2.0) == []  # not newer
    assert c.counters["release:stale"] == 1 and c.counters["releases"] == 1
    assert dict(c.snapshot(2.0).releases["det"]) == {"version": 2, "signer": "coord", "model": "file:v2"}
    assert c.snapshot(2.0).workload("a").doc["follows"] == "release:det"  # type: ignore[union-attr]
    c.handle(SetWorkload(workload("b", "file:aa"), 2), 3.0)  # b no longer follows it
    assert c.handle(ReleaseAccepted("det", 3, "file:v3", "coord"), 4.0) == [
        FollowRelease("det", 3, "file:v3", ("a",))]


def test_a_restore_brings_back_workloads_releases_and_quotas_without_sending_anything() -> None:
    c = core()
    w = replace(workload("a", "file:v1"), slo_s=0.5)
    out = c.handle(Restore(((w, 3, "release:det"),), {}, (), 2.0,
                           (ReleaseAccepted("det", 4, "file:v1", "coord"),)), 0.0)
    assert out == [] and c.follows == {"a": "det"} and c.releases["det"]["version"] == 4
    assert c.controller.workloads["a"].version == 3 and c.counters["releases"] == 0
    assert c.snapshot(0.0).workload("a").slo_s == 0.5  # type: ignore[union-attr]


def test_a_paused_owner_does_not_lose_the_devices_it_could_not_hear() -> None:
    """The shell's OwnerPaused moves the liveness deadlines: after a 4 s stall of the fog's loop the
    site keeps its device (no loss, nothing re-placed); the same tick without it loses the device."""
    from fog_broker.site_core import Advert, OwnerPaused
    from runtime.messages import DeviceBirth

    def fresh() -> SiteCore:
        c = core()
        c.handle(Advert(DeviceBirth(device_id="d1", epoch=1, seq=1, site="s", public_key=b"k" * 32, flops=1e9,
                                    memory_bytes=1_000_000, uplink_bps=1e8, downlink_bps=1e8, rtt_s=0.001,
                                    power_active_w=5.0, power_idle_w=2.0, state_interval_s=1.0)), 0.0)
        return c

    def lost(cmds: list) -> bool:
        return any(isinstance(c, SiteEvent) and c.kind == "device lost" for c in cmds)

    c = fresh()
    c.handle(OwnerPaused(4.0), 4.5)
    assert not lost(c.tick(4.5, 1e9))
    assert lost(fresh().tick(4.5, 1e9))
