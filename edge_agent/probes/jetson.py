"""Jetson power rails from the INA3221 monitors.

JetPack 5+ exposes them through hwmon (``in{N}_label``, ``in{N}_input`` mV,
``curr{N}_input`` mA); JetPack 4 through iio (``rail_name_{N}``,
``in_power{N}_input`` mW). The board total is the ``VDD_IN`` rail (Orin) or
``POM_5V_IN`` (Nano, TX2); without one, the sum of the rails.
"""
from __future__ import annotations

from pathlib import Path

from ._sysfs import glob_dirs, read_int, read_text

__all__ = ["rails", "total_power_w", "is_jetson"]

_TOTAL_RAILS = ("VDD_IN", "POM_5V_IN")


def _hwmon_dirs(root: Path | str) -> list[Path]:
    dirs = glob_dirs(root, "sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*")
    for d in glob_dirs(root, "sys/class/hwmon/hwmon*"):
        if read_text(d, "name") == "ina3221" and d not in dirs:
            dirs.append(d)
    return dirs


def rails(root: Path | str) -> dict[str, float]:
    """Power per named rail in watts."""
    out: dict[str, float] = {}
    for d in _hwmon_dirs(root):
        for n in range(1, 9):
            label = read_text(d, f"in{n}_label")
            if label is None:
                continue
            mv, ma = read_int(d, f"in{n}_input"), read_int(d, f"curr{n}_input")
            if mv is None or ma is None or label.upper() == "NC":
                continue
            out[label] = mv * ma / 1e6
    for d in glob_dirs(root, "sys/bus/i2c/drivers/ina3221x/*/iio:device*"):
        for n in range(8):
            name = read_text(d, f"rail_name_{n}")
            if name is None:
                continue
            mw = read_int(d, f"in_power{n}_input")
            if mw is None:
                mv, ma = read_int(d, f"in_voltage{n}_input"), read_int(d, f"in_current{n}_input")
                mw = mv * ma // 1000 if mv is not None and ma is not None else None
            if mw is not None:
                out[name] = mw / 1000.0
    return out


def total_power_w(rail_watts: dict[str, float]) -> float | None:
    for name in _TOTAL_RAILS:
        if name in rail_watts:
            return rail_watts[name]
    return sum(rail_watts.values()) if rail_watts else None


def is_jetson(root: Path | str) -> bool:
    return read_text(root, "etc/nv_tegra_release") is not None or "jetson" in (
        read_text(root, "proc/device-tree/model") or "").lower()
