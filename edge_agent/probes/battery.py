"""Battery from /sys/class/power_supply (pure over a root path); None means mains powered."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._sysfs import glob_dirs, read_int, read_text

__all__ = ["BatteryReading", "power_supply", "from_psutil"]


@dataclass(frozen=True, slots=True)
class BatteryReading:
    level: float  # 0..1
    charging: bool
    power_w: float | None = None


def power_supply(root: Path | str) -> BatteryReading | None:
    """The system battery (scope Device batteries, e.g. a mouse, are ignored)."""
    mains_online = False
    found: list[BatteryReading] = []
    for d in glob_dirs(root, "sys/class/power_supply/*"):
        kind = read_text(d, "type")
        if kind in ("Mains", "USB", "USB_C", "USB_PD"):
            mains_online = mains_online or read_int(d, "online") == 1
            continue
        if kind != "Battery" or read_text(d, "scope") == "Device" or read_int(d, "present") == 0:
            continue
        level = _level(d)
        if level is None:
            continue
        status = (read_text(d, "status") or "").lower()
        charging = status in ("charging", "full")
        found.append(BatteryReading(level, charging, _power_w(d)))
    if not found:
        return None
    bat = found[0]
    if mains_online and not bat.charging:
        # "Not charging" on AC (charge limit reached) still means: not draining
        bat = BatteryReading(bat.level, True, bat.power_w)
    return bat


def _level(d: Path) -> float | None:
    cap = read_int(d, "capacity")
    if cap is not None:
        return min(1.0, max(0.0, cap / 100.0))
    for now_name, full_name in (("energy_now", "energy_full"), ("charge_now", "charge_full")):
        now, full = read_int(d, now_name), read_int(d, full_name)
        if now is not None and full:
            return min(1.0, max(0.0, now / full))
    return None


def _power_w(d: Path) -> float | None:
    uw = read_int(d, "power_now")
    if uw is not None:
        return abs(uw) / 1e6
    ua, uv = read_int(d, "current_now"), read_int(d, "voltage_now")
    if ua is not None and uv is not None:
        return abs(ua) * uv / 1e12
    return None


def from_psutil(sb: object | None) -> BatteryReading | None:
    """Convert ``psutil.sensors_battery()`` (None means no battery: mains)."""
    if sb is None:
        return None
    percent = getattr(sb, "percent", None)
    if percent is None:
        return None
    return BatteryReading(min(1.0, max(0.0, float(percent) / 100.0)), bool(getattr(sb, "power_plugged", False)))
