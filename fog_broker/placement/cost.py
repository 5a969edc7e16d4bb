"""The reference cost model of COST_MODEL.md, as scalar functions over plain data.

These are the definitions; the optimiser in ``chain.py`` uses vectorised forms of
the same formulas, and tests check that the two agree on every plan they produce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .model import ChainProfile, Device, PartitionPlacement

__all__ = [
    "ChainCost", "transfer_time", "transfer_energy", "compute_time", "compute_energy",
    "partition_memory", "chain_cost",
]


@dataclass(frozen=True, slots=True)
class ChainCost:
    """Latency (s) and energy (J) of one replica chain."""

    latency_s: float
    energy_j: float

    def objective(self, name: str) -> float:
        return self.energy_j if name == "energy" else self.latency_s


def transfer_time(nbytes: float, a: Device, z: Device) -> float:
    """Zero on the same device, else half the two RTTs plus the bits over the slower link."""
    if a.id == z.id:
        return 0.0
    return (a.rtt_s + z.rtt_s) / 2.0 + 8.0 * nbytes / min(a.uplink_bps, z.downlink_bps)


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


def chain_cost(profile: ChainProfile, parts: Sequence[PartitionPlacement],
               devices: dict[str, Device], source: str, sink: str) -> ChainCost:
    """Latency and energy of ``parts`` (in chain order) from ``source`` to ``sink``."""
    segs = profile.segments
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
        en += d.power_active_w * t
        nbytes = segs[p.last].out_bytes
        prev = d
    lat += transfer_time(nbytes, prev, dst)
    en += transfer_energy(nbytes, prev, dst)
    return ChainCost(lat, en)
