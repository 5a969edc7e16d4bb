"""The reference cost model of COST_MODEL.md, as scalar functions over plain data.

These are the definitions; the optimiser in ``chain.py`` uses vectorised forms of
the same formulas, and tests check that the two agree on every plan they produce.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .model import ChainProfile, Device
from .plan import PartitionPlacement

__all__ = [
    "ChainCost", "transfer_time", "transfer_energy", "compute_time", "compute_energy",
    "partition_memory", "chain_cost", "link_time", "stage_times",
]


@dataclass(frozen=True, slots=True)
class ChainCost:
    """Latency (s), energy (J) and bottleneck stage (s) of one replica chain.

    ``bottleneck_s`` is the slowest pipeline stage (``stage_times``); a pipelined chain
    serves at most ``1 / bottleneck_s`` frames per second.
    """

    latency_s: float
    energy_j: float
    bottleneck_s: float = 0.0

    def objective(self, name: str) -> float:
        if name == "throughput":
            return self.bottleneck_s
        return self.energy_j if name == "energy" else self.latency_s


def transfer_time(nbytes: float, a: Device, z: Device) -> float:
    """Zero on the same device, else half the two RTTs plus the bits over the slower link."""
    if a.id == z.id:
        return 0.0
    return (a.rtt_s + z.rtt_s) / 2.0 + 8.0 * nbytes / min(a.uplink_bps, z.downlink_bps)


def link_time(nbytes: float, a: Device, z: Device) -> float:
    """How long a transfer occupies the link: the bits over the slower side, no RTT.

    Propagation delay adds latency but overlaps between frames in flight, so it does not
    limit throughput; serialisation does.
    """
    if a.id == z.id:
        return 0.0
    return 8.0 * nbytes / min(a.uplink_bps, z.downlink_bps)


def transfer_energy(nbytes: float, a: Device, z: Device) -> float:
    if a.id == z.id:
        return 0.0
    return nbytes * a.tx_j_per_byte + nbytes * z.rx_j_per_byte


def compute_time(flops: float, d: Device) -> float:
    """The reference model's compute time; ``ChainProfile.compute_s`` prefers measured times."""
    return flops / d.flops


def compute_energy(flops: float, d: Device) -> float:
    return d.power_active_w * (flops / d.flops)


def partition_memory(profile: ChainProfile, first: int, last: int) -> float:
    return profile.memory_of(first, last)


def stage_times(profile: ChainProfile, parts: Sequence[PartitionPlacement],
                devices: dict[str, Device], source: str, sink: str
                ) -> list[tuple[str, float]]:
    """The pipeline stages of a chain in order, as ``(name, seconds)``.

    A stage is each partition's compute on its device (``"compute <device>"``) and each
    link a frame crosses, the input's and the output's included (``"link <a>-><z>"``,
    ``link_time``); links inside one device are free and omitted.
    """
    out: list[tuple[str, float]] = []
    prev = devices[source]
    nbytes = profile.input_bytes
    for p in parts:
        d = devices[p.device]
        if prev.id != d.id:
            out.append((f"link {prev.id}->{d.id}", link_time(nbytes, prev, d)))
        out.append((f"compute {d.id}", profile.compute_s(p.first, p.last, d)))
        nbytes = profile.cut_bytes(p.last)
        prev = d
    if prev.id != sink:
        out.append((f"link {prev.id}->{sink}", link_time(nbytes, prev, devices[sink])))
    return out


def chain_cost(profile: ChainProfile, parts: Sequence[PartitionPlacement],
               devices: dict[str, Device], source: str, sink: str) -> ChainCost:
    """Latency, energy and bottleneck of ``parts`` (in chain order) from ``source`` to ``sink``."""
    src, dst = devices[source], devices[sink]
    prev = src
    nbytes = profile.input_bytes
    lat = en = 0.0
    for p in parts:
        d = devices[p.device]
        lat += transfer_time(nbytes, prev, d)
        en += transfer_energy(nbytes, prev, d)
        t = profile.compute_s(p.first, p.last, d)  # measured where reported, else FLOPs
        lat += t
        # Zero power draws nothing however long it runs (the optimiser's P/F * FLOPs agrees).
        en += d.power_active_w * t if d.power_active_w > 0 else 0.0
        nbytes = profile.cut_bytes(p.last)  # on the cut's wire; the answer float32
        prev = d
    lat += transfer_time(nbytes, prev, dst)
    en += transfer_energy(nbytes, prev, dst)
    stages = stage_times(profile, parts, devices, source, sink)
    return ChainCost(lat, en, max((t for _, t in stages), default=0.0))
