"""CPU and memory figures from /proc and /sys text (pure parsers plus root-based readers)."""
from __future__ import annotations

from pathlib import Path

from ._sysfs import glob_dirs, parse_int, read_int, read_text

__all__ = ["parse_meminfo", "parse_loadavg", "parse_cpu_list", "cpu_count", "cpu_freq_mhz", "meminfo"]


def parse_meminfo(text: str) -> tuple[int, int] | None:
    """(total, available) bytes from /proc/meminfo text; MemAvailable falls back to Free+Cached."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        value = parse_int(rest)
        if value is not None:
            unit = rest.split()[1].lower() if len(rest.split()) > 1 else ""
            fields[name.strip()] = value * 1024 if unit == "kb" else value
    total = fields.get("MemTotal")
    if total is None:
        return None
    avail = fields.get("MemAvailable")
    if avail is None:
        avail = fields.get("MemFree", 0) + fields.get("Buffers", 0) + fields.get("Cached", 0)
    return total, min(avail, total)


def parse_loadavg(text: str) -> float | None:
    """One-minute load average from /proc/loadavg text."""
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def parse_cpu_list(text: str) -> int | None:
    """Number of CPUs in a kernel cpu list such as ``0-3`` or ``0-3,6,8-9``."""
    count = 0
    try:
        for part in text.strip().split(","):
            if not part:
                continue
            lo, _, hi = part.partition("-")
            count += (int(hi) - int(lo) + 1) if hi else 1
    except ValueError:
        return None
    return count or None


def meminfo(root: Path | str) -> tuple[int, int] | None:
    text = read_text(root, "proc/meminfo")
    return parse_meminfo(text) if text else None


def cpu_count(root: Path | str) -> int | None:
    text = read_text(root, "sys/devices/system/cpu/online")
    return parse_cpu_list(text) if text else None


def cpu_freq_mhz(root: Path | str) -> tuple[float | None, float | None]:
    """(mean current, highest max) frequency in MHz over the cpufreq policies."""
    cur: list[int] = []
    top: list[int] = []
    for d in glob_dirs(root, "sys/devices/system/cpu/cpu[0-9]*/cpufreq"):
        c = read_int(d, "scaling_cur_freq")
        m = read_int(d, "cpuinfo_max_freq")
        if c is not None:
            cur.append(c)
        if m is not None:
            top.append(m)
    return (sum(cur) / len(cur) / 1000.0 if cur else None, max(top) / 1000.0 if top else None)
