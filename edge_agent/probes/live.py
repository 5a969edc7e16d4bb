"""The real device's probe: sysfs parsers plus psutil, read at most once per call."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import psutil

from ..readings import Capabilities, Reading
from . import battery, cpu, jetson, pi, providers, thermal

__all__ = ["LiveProbe", "arch_label"]

_VCGENCMD_EVERY_S = 5.0


def arch_label(machine: str) -> str:
    m = machine.lower()
    if m in ("x86_64", "amd64"):
        return "amd64"
    if m in ("aarch64", "arm64"):
        return "arm64"
    if m.startswith("arm"):
        return "arm"
    return m or "unknown"


def run_vcgencmd(exe: str) -> str | None:
    try:
        out = subprocess.run([exe, "get_throttled"], capture_output=True, timeout=2, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode("ascii", "replace") if out.returncode == 0 else None


class LiveProbe:
    """Probes this machine. ``root`` is ``/`` except in tests."""

    def __init__(self, root: str | Path = "/", *, flops: float | None = None,
                 vcgencmd: str | None = None) -> None:
        self.root = Path(root)
        self._flops = flops
        self._vcgencmd = vcgencmd if vcgencmd is not None else shutil.which("vcgencmd")
        self._throttle_at = -1e9
        self._throttle: pi.Throttle | None = None
        self.model = pi.board_model(self.root)
        self.kind = pi.device_kind(self.model)
        self._jetson = jetson.is_jetson(self.root)

    def capabilities(self) -> Capabilities:
        from simulations.profiles import PROFILES  # noqa: PLC0415 - small table, only at birth

        ncpu = cpu.cpu_count(self.root) or os.cpu_count() or 1
        mem = psutil.virtual_memory()
        provs = providers.installed()
        accel = ("cuda",) if ("CUDAExecutionProvider" in provs or self._jetson) else ()
        prof = PROFILES.get(self.kind)
        _, max_mhz = cpu.cpu_freq_mhz(self.root)
        if self._flops:
            flops = self._flops
        elif prof is not None:
            flops = prof.flops
        else:  # rough: effective onnxruntime FP32 is ~2 (ARM) / ~4 (x86 AVX2) FLOP per cycle per core
            per_cycle = 4.0 if arch_label(platform.machine()) == "amd64" else 2.0
            flops = ncpu * (max_mhz or 1500.0) * 1e6 * per_cycle
        bat = battery.power_supply(self.root)
        labels = {"arch": arch_label(platform.machine()), "accelerator": accel[0] if accel else "none"}
        if self.kind:
            labels["device-model"] = self.kind
        return Capabilities(
            flops=flops, memory_bytes=int(mem.available * 0.9),
            uplink_bps=prof.uplink_bps if prof else 100e6, downlink_bps=prof.downlink_bps if prof else 100e6,
            rtt_s=prof.rtt_s if prof else 0.002,
            power_active_w=prof.power_active_w if prof else 3.0 + 2.0 * ncpu,
            power_idle_w=prof.power_idle_w if prof else 3.0,
            tx_j_per_byte=prof.tx_j_per_byte if prof else 4e-8, rx_j_per_byte=prof.rx_j_per_byte if prof else 4e-8,
            battery_capacity_wh=_capacity_wh(self.root) if bat is not None else None,
            cpu_count=ncpu, accelerators=accel, providers=provs, labels=labels,
            simulated=False, model=self.model or platform.node())

    def read(self, now: float, busy_s: float = 0.0) -> Reading:
        mem = psutil.virtual_memory()
        try:
            load = os.getloadavg()[0] / (os.cpu_count() or 1)
        except OSError:
            load = 0.0
        zones = thermal.zones(self.root)
        throttled = thermal.over_passive_trip(zones)
        if self._vcgencmd and now - self._throttle_at >= _VCGENCMD_EVERY_S:
            self._throttle_at = now
            self._throttle = pi.parse_throttled(run_vcgencmd(self._vcgencmd))
        if self._throttle is not None:
            throttled = throttled or self._throttle.active
        bat = battery.power_supply(self.root)
        if bat is None and platform.system() != "Linux":
            bat = battery.from_psutil(_psutil_battery())
        power = None
        if self._jetson:
            power = jetson.total_power_w(jetson.rails(self.root))
        if power is None:
            ups = pi.ina219(self.root)
            if ups is not None:
                power = ups.power_w
                if bat is None:
                    bat = battery.Battery(pi.ups_battery_level(ups.bus_v), ups.current_a > 0, ups.power_w)
        if power is None and bat is not None and not bat.charging:
            power = bat.power_w
        freq, _ = cpu.cpu_freq_mhz(self.root)
        return Reading(
            free_memory_bytes=int(mem.available), cpu_load=round(load, 3), cpu_freq_mhz=freq,
            temperature_c=thermal.cpu_temperature(zones), throttled=throttled,
            battery_level=bat.level if bat else None, charging=bat.charging if bat else False,
            power_w=power)


def _capacity_wh(root: Path) -> float | None:
    from ._sysfs import glob_dirs, read_int, read_text  # noqa: PLC0415

    for d in glob_dirs(root, "sys/class/power_supply/*"):
        if read_text(d, "type") == "Battery" and read_text(d, "scope") != "Device":
            full = read_int(d, "energy_full")
            if full:
                return full / 1e6  # uWh -> Wh
    return None


def _psutil_battery() -> object | None:
    try:
        battery_info: object | None = psutil.sensors_battery()
        return battery_info
    except (AttributeError, NotImplementedError, OSError):
        return None
