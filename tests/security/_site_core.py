"""A real ``SiteCore`` and devices that deploy, ack, serve and advertise what they are told to
(an attacker's figures are simply false ones): the fog's whole decision path, no broker."""
from __future__ import annotations

from collections.abc import Sequence

from fog_broker.controller import DeployPartition, UndeployPartition
from fog_broker.placement.scheduler import schedule
from fog_broker.site_core import Ack, Advert, SiteCore, SiteCoreConfig, SiteEvent
from fog_broker.slow_stages import SlowStageConfig
from runtime.messages import DeviceBirth, DeviceState, PartitionStatus

MB = 1_000_000
CFG = SlowStageConfig(factor=2.0, recover=1.25, sustain=3, hold_s=10.0, max_hold_s=40.0, min_excess_s=0.01)
#: id -> (claimed FLOP/s, memory, labels, the calibration and p50 it reports)
Spec = tuple[float, int, tuple[tuple[str, str], ...], float]


def birth(dev: str, spec: Spec, uplink_bps: float = 1e8) -> DeviceBirth:
    flops, mem, labels, _ = spec
    return DeviceBirth(device_id=dev, epoch=1, seq=1, site="s", public_key=bytes(32), flops=flops,
                       memory_bytes=mem, uplink_bps=uplink_bps, downlink_bps=1e8, rtt_s=1e-3,
                       power_active_w=5.0, power_idle_w=1.0, tx_j_per_byte=1e-8,
                       rx_j_per_byte=1e-8, state_interval_s=1.0, labels=dict(labels))


class Site:
    """A SiteCore and its devices; ``join`` adds one later, ``step`` is half a second of adverts."""

    def __init__(self, devices: dict[str, Spec]) -> None:
        self.core = SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0, slow_stages=CFG))
        self.now = 0.0
        self.devices: dict[str, Spec] = {}
        self.running: dict[str, dict[tuple[str, int, int, int], int]] = {}
        self.seq: dict[str, int] = {}
        self.uplink: dict[str, float | None] = {}
        self.events: list[SiteEvent] = []
        for d, spec in devices.items():
            self.join(d, spec)

    def join(self, dev: str, spec: Spec, uplink_bps: float | None = None) -> None:
        self.devices[dev], self.running[dev], self.seq[dev], self.uplink[dev] = spec, {}, 1, uplink_bps
        self.carry(self.core.handle(Advert(birth(dev, spec)), self.now))

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
        for d, spec in self.devices.items():
            self.seq[d] += 1
            secs = spec[3]
            parts = []
            for key in self.running[d]:
                self.running[d][key] += 20
                parts.append(PartitionStatus(*key, sha256="0" * 64, health="running", p50_s=secs,
                                             served=self.running[d][key], calib_s=secs))
            msg = DeviceState(device_id=d, epoch=1, seq=self.seq[d], free_memory_bytes=spec[1],
                              uplink_bps=self.uplink[d], partitions=tuple(parts))
            self.carry(self.core.handle(Advert(msg), self.now))
        self.carry(self.core.tick(self.now, 1e9 + self.now))

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()
