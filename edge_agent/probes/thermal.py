"""Temperatures and thermal throttling from /sys/class/thermal (pure over a root path)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._sysfs import glob_dirs, read_int, read_text

__all__ = ["Zone", "zones", "cpu_temperature", "over_passive_trip"]

# Zone types that describe the CPU/SoC die; others (wifi, battery, pch) are ignored
# when one of these exists.
_CPU_HINTS = ("cpu", "soc", "x86_pkg", "tj", "coretemp", "k10temp", "bcm2835", "acpitz")


@dataclass(frozen=True, slots=True)
class Zone:
    type: str
    temp_c: float
    passive_trip_c: float | None = None


def _millideg(value: int | None) -> float | None:
    if value is None or value <= -273_000 or value > 200_000:
        return None  # unread sensor (-ENODATA) or a bogus value
    return value / 1000.0


def zones(root: Path | str) -> list[Zone]:
    out = []
    for d in glob_dirs(root, "sys/class/thermal/thermal_zone*"):
        temp = _millideg(read_int(d, "temp"))
        if temp is None:
            continue
        passive = None
        for i in range(16):
            kind = read_text(d, f"trip_point_{i}_type")
            if kind is None:
                break
            if kind == "passive":
                t = _millideg(read_int(d, f"trip_point_{i}_temp"))
                if t is not None and t > 0:
                    passive = t if passive is None else min(passive, t)
        out.append(Zone(read_text(d, "type") or d.name, temp, passive))
    return out


def _cpu_zones(zs: list[Zone]) -> list[Zone]:
    cpu = [z for z in zs if any(h in z.type.lower() for h in _CPU_HINTS)]
    return cpu or zs


def cpu_temperature(zs: list[Zone]) -> float | None:
    """Hottest CPU/SoC zone (all zones when none is recognisably the CPU)."""
    cpu = _cpu_zones(zs)
    return max(z.temp_c for z in cpu) if cpu else None


def over_passive_trip(zs: list[Zone]) -> bool:
    """True when a CPU/SoC zone is at or above its passive trip point (the kernel throttles)."""
    return any(z.passive_trip_c is not None and z.temp_c >= z.passive_trip_c for z in _cpu_zones(zs))
