"""Issue 29, claimed capacity still won: what a fresh device says about itself led placement.

Before: a fresh device claiming 4.9e14 FLOP/s (just under the clamp) took replica 0 of the next
workload on a site whose honest devices the fog had measured; a calibration of 50 us is below the
floor that counts as a measurement, so the liar was never measured nor flagged; a state advert's
``uplink_bps`` was taken as sent up to 1e13. Now a device the fog has not measured holds no first
(or only) replica while a measured device can (a fresh site's first workload still starts on
unmeasured ones), a calibration below the floor measures nothing, and the advertised uplink is
capped at what any real link reaches. The real ``SiteCore`` is fed the liar's adverts.
"""
from __future__ import annotations

from _site_core import MB, Site

from fog_broker.placement.model import ChainProfile, Segment, Workload
from fog_broker.site_core import SetWorkload

LIAR = "liar"
HONEST = {"src": (1e6, 1, (), 0.0),
          "h1": (2e10, 100 * MB, (), 0.1),   # 2e9 FLOPs in 0.1 s: what it claims
          "h2": (1e10, 100 * MB, (), 0.2)}
LYING = (4.9e14, 100 * MB, (), 50e-6)        # claims 4.9e14, reports a 50 us calibration


def workload(name: str, replicas: int = 1) -> Workload:
    prof = ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e9, 1 * MB, 1 * MB, 1000.0) for i in range(2)))
    return Workload(name=name, source="src", sink="src", profile=prof, replicas=replicas)


def first_replica_devices(site: Site, name: str) -> set[str]:
    return {d for d, parts in site.running.items() for (w, _, r, _) in parts if w == name and r == 0}


def test_a_fresh_liar_takes_no_first_replica_from_measured_devices() -> None:
    site = Site(HONEST)
    site.carry(site.core.handle(SetWorkload(workload("w1", replicas=2), 1), site.now))
    site.steps(6)
    assert site.core.registry.devices["h1"].measured_flops and site.core.registry.devices["h2"].measured_flops
    site.join(LIAR, LYING, uplink_bps=1e13)
    site.steps(2)
    site.carry(site.core.handle(SetWorkload(workload("w2"), 1), site.now))
    site.steps(6)
    assert first_replica_devices(site, "w2") and LIAR not in first_replica_devices(site, "w2"), site.running
    # it may serve a later replica: its 50 us calibration measures nothing, so it stays unmeasured
    site.carry(site.core.handle(SetWorkload(workload("w3", replicas=3), 1), site.now))
    site.steps(6)
    assert any(w == "w3" for (w, _, _, _) in site.running[LIAR]), site.running
    assert site.core.registry.devices[LIAR].measured_flops is None
    site.carry(site.core.handle(SetWorkload(workload("w4"), 1), site.now))
    site.steps(6)
    assert first_replica_devices(site, "w4") and LIAR not in first_replica_devices(site, "w4"), site.running
    fleet = site.core.registry.fleet()
    liar = fleet.devices[fleet.index[LIAR]]
    assert not liar.measured and liar.uplink_bps <= 1e11  # its 1e13 "uplink" is capped


def test_a_fresh_site_still_places_on_unmeasured_devices() -> None:
    site = Site(HONEST)
    site.carry(site.core.handle(SetWorkload(workload("w"), 1), site.now))
    site.steps(4)
    assert first_replica_devices(site, "w") == {"h1"}
