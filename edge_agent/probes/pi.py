"""Raspberry Pi: board model, ``vcgencmd get_throttled``, and a UPS HAT's INA219 (hwmon)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._sysfs import glob_dirs, read_int, read_text

__all__ = ["Throttle", "parse_throttled", "board_model", "device_kind", "Ina219", "ina219",
           "ups_battery_level", "parse_pmic_adc", "pmic_rails_w", "pmic_power_w"]

# get_throttled bits (Raspberry Pi documentation): 0-3 now, 16-19 since boot.
UNDER_VOLTAGE, FREQ_CAPPED, THROTTLED, SOFT_TEMP_LIMIT = 0x1, 0x2, 0x4, 0x8


@dataclass(frozen=True, slots=True)
class Throttle:
    raw: int
    under_voltage: bool
    freq_capped: bool
    throttled: bool
    soft_temp_limit: bool
    occurred: bool  # any of the above since boot

    @property
    def active(self) -> bool:
        return bool(self.raw & 0xF)


def parse_throttled(text: str | None) -> Throttle | None:
    """Parse ``throttled=0x50005``; None for anything else (vcgencmd missing or failing)."""
    if not text:
        return None
    _, sep, value = text.strip().partition("throttled=")
    if not sep:
        return None
    try:
        raw = int(value.split()[0], 16)
    except (ValueError, IndexError):
        return None
    return Throttle(raw, bool(raw & UNDER_VOLTAGE), bool(raw & FREQ_CAPPED), bool(raw & THROTTLED),
                    bool(raw & SOFT_TEMP_LIMIT), bool(raw & 0xF0000))


def board_model(root: Path | str) -> str:
    """The board's model string from the device tree (empty on PCs)."""
    return read_text(root, "proc/device-tree/model") or read_text(root, "sys/firmware/devicetree/base/model") or ""


def device_kind(model: str) -> str:
    """Map a device-tree model string to a profile name ("" when unknown)."""
    m = model.lower()
    if "raspberry pi 5" in m:
        return "pi5"
    if "raspberry pi 4" in m or "raspberry pi compute module 4" in m:
        return "pi4"
    if "orin nano" in m:
        return "orin-nano"
    if "jetson nano" in m or "jetson-nano" in m:
        return "jetson-nano"
    return ""


@dataclass(frozen=True, slots=True)
class Ina219:
    bus_v: float
    current_a: float  # positive: discharging into the Pi (Waveshare UPS HAT convention is signed)
    power_w: float


def ina219(root: Path | str) -> Ina219 | None:
    """First hwmon device named ``ina219`` (the ina2xx driver): in1 mV, curr1 mA, power1 uW."""
    for d in glob_dirs(root, "sys/class/hwmon/hwmon*"):
        if read_text(d, "name") != "ina219":
            continue
        mv = read_int(d, "in1_input")
        ma = read_int(d, "curr1_input")
        uw = read_int(d, "power1_input")
        if mv is None:
            continue
        current = (ma or 0) / 1000.0
        power = uw / 1e6 if uw is not None else abs(mv / 1000.0 * current)
        return Ina219(mv / 1000.0, current, power)
    return None


def ups_battery_level(bus_v: float, cells: int = 2) -> float:
    """Li-ion pack level from voltage, linear 3.0-4.2 V per cell (as UPS HAT examples do)."""
    per_cell = bus_v / cells
    return min(1.0, max(0.0, (per_cell - 3.0) / 1.2))


def parse_pmic_adc(text: str | None) -> tuple[dict[str, float], dict[str, float]]:
    """``vcgencmd pmic_read_adc`` (Raspberry Pi 5's PMIC): (amps, volts) per rail name.

    Lines read ``VDD_CORE_A current(7)=0.70848000A`` and ``VDD_CORE_V volt(15)=0.88247060V``;
    the rail is the name without its ``_A``/``_V`` suffix. Anything else is skipped.
    """
    amps: dict[str, float] = {}
    volts: dict[str, float] = {}
    for line in (text or "").splitlines():
        cols = line.split()
        if len(cols) != 2 or "=" not in cols[1]:
            continue
        name, (kind, _, value) = cols[0], cols[1].partition("=")
        try:
            number = float(value.rstrip("AV"))
        except ValueError:
            continue
        if number != number or number < 0:  # NaN or nonsense: not a reading
            continue
        if kind.startswith("current(") and name.endswith("_A"):
            amps[name[:-2]] = number
        elif kind.startswith("volt(") and name.endswith("_V"):
            volts[name[:-2]] = number
    return amps, volts


def pmic_rails_w(text: str | None) -> dict[str, float]:
    """Power per PMIC rail that has both a current and a voltage reading, in watts."""
    amps, volts = parse_pmic_adc(text)
    return {rail: amps[rail] * volts[rail] for rail in sorted(amps) if rail in volts}


def pmic_power_w(text: str | None) -> float | None:
    """The sum over the PMIC's rails: the SoC, memory and I/O supplies, not USB peripherals.

    It is what the board's own chips draw, which is what a partition changes; None without
    rails (an older Pi, or vcgencmd missing).
    """
    rails = pmic_rails_w(text)
    return sum(rails.values()) if rails else None
