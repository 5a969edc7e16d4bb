"""Issue 29, calibration poisoning: a device's label decided whose measured times its lies became.

Before: measured segment times were filed under a self-declared ``device-class`` label and looked
up by device id first, so a device labelled ``device-class=<victim id>`` that reported a 50 us
calibration made the victim's plan 0.05 ms; the honest victim was then "2000x the plan", set aside
(doubling holds), and placement followed the fake costs. Now a device's measured times are keyed
by the id the broker authenticated, a class never names a device (a label equal to a known device
id is no class), class times live in their own namespace (``class:NAME``) as the upper median of
the class's devices, and a stage is judged by its own device's measurements only.

The real ``SiteCore`` (registry, controller, scheduler, calibration, slow-stage rule) is fed the
adverts a lying agent sends; the attacker does not follow our protocol's honesty, only its format.
"""
from __future__ import annotations

from _site_core import MB, Site, birth

from fog_broker.placement.model import ChainProfile, Segment, Workload
from fog_broker.site_core import Advert, SetWorkload

VICTIM, LIAR = "victim", "liar"
DEVICES = {"src": (1e6, 1, (), 0.0),
           VICTIM: (2e10, 100 * MB, (("device-class", "pi4"),), 0.1),  # honest: 2e9 FLOPs in 0.1 s
           "peer": (1e10, 100 * MB, (("device-class", "pi4"),), 0.2),
           LIAR: (1e10, 100 * MB, (("device-class", VICTIM),), 50e-6)}   # names the victim, lies


def workload(name: str) -> Workload:
    prof = ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e9, 1 * MB, 1 * MB, 1000.0) for i in range(2)))
    return Workload(name=name, source="src", sink="src", profile=prof, replicas=3)


def test_a_label_naming_the_victim_does_not_set_the_victim_aside() -> None:
    site = Site(DEVICES)
    site.carry(site.core.handle(SetWorkload(workload("w"), 1), site.now))
    site.steps(40)
    assert site.running[VICTIM] and site.running[LIAR], site.running  # both calibrated something
    assert not any(e.kind == "stage slow" and e.device == VICTIM for e in site.events), site.events
    assert VICTIM not in site.core.slow_stages.set_aside
    times = dict(site.core.controller.workloads["w"].spec.profile.segment_times)
    assert sum(times[VICTIM]) > 0.05              # the victim's own times: its own 0.1 s, not 50 us
    assert "class:" + VICTIM not in times         # no class named after a device
    # the class of the honest pair is theirs alone (the liar is in no class)
    assert sum(times["class:pi4"]) >= 0.1


def test_a_class_label_naming_a_device_is_no_class_even_when_the_device_joins_later() -> None:
    core = Site({}).core
    core.handle(Advert(birth(LIAR, DEVICES[LIAR])), 0.0)
    fleet = core.registry.fleet()
    assert fleet.devices[fleet.index[LIAR]].device_class == VICTIM  # no such device (yet): a class
    core.handle(Advert(birth(VICTIM, DEVICES[VICTIM])), 0.1)                          # the victim comes
    fleet = core.registry.fleet()
    assert fleet.devices[fleet.index[LIAR]].device_class == ""       # the liar's label is no class now
    assert fleet.devices[fleet.index[VICTIM]].device_class == "pi4"
    assert core.registry.device_class(LIAR) == "" and core.registry.device_class(VICTIM) == "pi4"
