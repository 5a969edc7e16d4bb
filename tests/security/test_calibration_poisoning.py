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

from collections.abc import Sequence

from fog_broker.controller import DeployPartition, UndeployPartition
from fog_broker.placement.model import ChainProfile, Segment, Workload
from fog_broker.placement.scheduler import schedule
from fog_broker.site_core import Ack, Advert, SetWorkload, SiteCore, SiteCoreConfig, SiteEvent
from fog_broker.slow_stages import SlowStageConfig
from runtime.messages import DeviceBirth, DeviceState, PartitionStatus

MB = 1_000_000
CFG = SlowStageConfig(factor=2.0, recover=1.25, sustain=3, hold_s=10.0, max_hold_s=40.0, min_excess_s=0.01)
VICTIM, LIAR = "victim", "liar"
#: id -> (claimed FLOP/s, memory, labels, the calibration and p50 it reports)
DEVICES = {"src": (1e6, 1, (), 0.0),
           VICTIM: (2e10, 100 * MB, (("device-class", "pi4"),), 0.1),  # honest: 2e9 FLOPs in 0.1 s
           "peer": (1e10, 100 * MB, (("device-class", "pi4"),), 0.2),
           LIAR: (1e10, 100 * MB, (("device-class", VICTIM),), 50e-6)}   # names the victim, lies


def birth(dev: str) -> DeviceBirth:
    flops, mem, labels, _ = DEVICES[dev]
    return DeviceBirth(device_id=dev, epoch=1, seq=1, site="s", public_key=bytes(32), flops=flops,
                       memory_bytes=mem, uplink_bps=1e8, downlink_bps=1e8, rtt_s=1e-3,
                       power_active_w=5.0, power_idle_w=1.0, tx_j_per_byte=1e-8,
                       rx_j_per_byte=1e-8, state_interval_s=1.0, labels=dict(labels))


def workload(name: str) -> Workload:
    prof = ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e9, 1 * MB, 1 * MB, 1000.0) for i in range(2)))
    return Workload(name=name, source="src", sink="src", profile=prof, replicas=3)


class Site:
    """A SiteCore and devices that deploy, ack, serve and advertise (the liar's figures are false)."""

    def __init__(self) -> None:
        self.core = SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0, slow_stages=CFG))
        self.now = 0.0
        self.running: dict[str, dict[tuple[str, int, int, int], int]] = {d: {} for d in DEVICES}
        self.seq = dict.fromkeys(DEVICES, 1)
        self.events: list[SiteEvent] = []
        for d in DEVICES:
            self.carry(self.core.handle(Advert(birth(d)), self.now))

    def carry(self, cmds: Sequence[object]) -> None:
        queue = list(cmds)
        while queue:
            c = queue.pop(0)
            if isinstance(c, SiteEvent):
                self.events.append(c)
            elif isinstance(c, DeployPartition):
                self.running[c.device][(c.workload, c.version, c.replica, c.index)] = 0
                queue += self.core.handle(Ack(c.device, c.command_id, True, ""), self.now)
            elif isinstance(c, UndeployPartition):
                self.running[c.device].pop((c.workload, c.version, c.replica, c.index), None)

    def step(self) -> None:
        self.now += 0.5
        for d in DEVICES:
            self.seq[d] += 1
            secs = DEVICES[d][3]
            parts = []
            for key in self.running[d]:
                self.running[d][key] += 20
                parts.append(PartitionStatus(*key, sha256="0" * 64, health="running", p50_s=secs,
                                             served=self.running[d][key], calib_s=secs))
            msg = DeviceState(device_id=d, epoch=1, seq=self.seq[d], free_memory_bytes=DEVICES[d][1],
                              partitions=tuple(parts))
            self.carry(self.core.handle(Advert(msg), self.now))
        self.carry(self.core.tick(self.now, 1e9 + self.now))


def test_a_label_naming_the_victim_does_not_set_the_victim_aside() -> None:
    site = Site()
    site.carry(site.core.handle(SetWorkload(workload("w"), 1), site.now))
    for _ in range(40):
        site.step()
    assert site.running[VICTIM] and site.running[LIAR], site.running  # both calibrated something
    assert not any(e.kind == "stage slow" and e.device == VICTIM for e in site.events), site.events
    assert VICTIM not in site.core.view().slow
    times = dict(site.core.controller.workloads["w"].spec.profile.segment_times)
    assert sum(times[VICTIM]) > 0.05              # the victim's own times: its own 0.1 s, not 50 us
    assert "class:" + VICTIM not in times         # no class named after a device
    # the class of the honest pair is theirs alone (the liar is in no class)
    assert sum(times["class:pi4"]) >= 0.1


def test_a_class_label_naming_a_device_is_no_class_even_when_the_device_joins_later() -> None:
    core = SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0, slow_stages=CFG))
    core.handle(Advert(birth(LIAR)), 0.0)
    fleet = core.registry.fleet()
    assert fleet.devices[fleet.index[LIAR]].device_class == VICTIM  # no such device (yet): a class
    core.handle(Advert(birth(VICTIM)), 0.1)                          # the victim comes
    fleet = core.registry.fleet()
    assert fleet.devices[fleet.index[LIAR]].device_class == ""       # the liar's label is no class now
    assert fleet.devices[fleet.index[VICTIM]].device_class == "pi4"
    assert core.registry.device_class(LIAR) == "" and core.registry.device_class(VICTIM) == "pi4"
