"""Intel RAPL energy counters under /sys/class/powercap (pure over a root path).

Each package domain ``intel-rapl:N`` has a cumulative ``energy_uj`` that wraps at
``max_energy_range_uj``; its subzones (``intel-rapl:N:M``: core, uncore, dram) are parts of
it and are not added again. Since Linux 5.10 ``energy_uj`` is readable by root only
(CVE-2020-8694): an agent running as a plain user sees no counter, so its figures stay modelled.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ._sysfs import glob_dirs, read_int, read_text

__all__ = ["Counter", "packages", "domains", "delta_uj"]

_PACKAGE = re.compile(r"^intel-rapl:\d+$")


@dataclass(frozen=True, slots=True)
class Counter:
    name: str  # "package-0", "psys"
    energy_uj: int
    max_energy_range_uj: int


def packages(root: Path | str) -> list[Counter]:
    """Top-level RAPL domains with a readable counter (psys, when present, is the whole SoC)."""
    out = []
    for d in glob_dirs(root, "sys/class/powercap/intel-rapl:*"):
        if not _PACKAGE.match(d.name):
            continue
        uj, top = read_int(d, "energy_uj"), read_int(d, "max_energy_range_uj")
        if uj is None or top is None or top <= 0 or not 0 <= uj <= top:
            continue
        out.append(Counter(read_text(d, "name") or d.name, uj, top))
    return out


def domains(counters: list[Counter]) -> list[Counter]:
    """The domains to add up: ``psys`` alone when the platform has it, else every package."""
    psys = [c for c in counters if c.name == "psys"]
    return psys or counters


def delta_uj(before: int, after: int, max_range_uj: int) -> int:
    """Energy between two readings of one counter, across at most one wrap-around."""
    return after - before if after >= before else max_range_uj - before + after
