"""The real device's probe: sysfs parsers plus psutil, read at most once per call.

Commands (``vcgencmd``, ``nmcli``) go through one runner, so tests hand it recorded outputs.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from ..readings import Capabilities, Reading
from . import battery, cpu, energy, jetson, network, pi, providers, rapl, thermal

__all__ = ["LiveProbe", "arch_label", "run_command"]

_VCGENCMD_EVERY_S = 5.0
_NMCLI_EVERY_S = 30.0  # a link's metered flag changes when the owner changes networks: rarely
_SAMPLE_EVERY_S = 0.05  # power-rail sampling during an energy measurement

Runner = Callable[[Sequence[str]], str | None]


def arch_label(machine: str) -> str:
    m = machine.lower()
    if m in ("x86_64", "amd64"):
        return "amd64"
    if m in ("aarch64", "arm64"):
        return "arm64"
    if m.startswith("arm"):
        return "arm"
    return m or "unknown"


def run_command(argv: Sequence[str]) -> str | None:
    """A probe command's stdout, None when it is missing, fails or hangs (2 s)."""
    try:
        out = subprocess.run(list(argv), capture_output=True, timeout=2, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode("utf-8", "replace") if out.returncode == 0 else None


class LiveProbe:
    """Probes this machine. ``root`` is ``/`` except in tests (or a host's /sys mounted elsewhere).

    ``metered`` overrides NetworkManager's answer (the operator knows the link); ``run`` runs
    probe commands (tests pass recorded outputs).
    """

    def __init__(self, root: str | Path = "/", *, flops: float | None = None,
                 vcgencmd: str | None = None, nmcli: str | None = None, metered: bool | None = None,
                 run: Runner = run_command) -> None:
        self.root = Path(root)
        self._flops = flops
        self._vcgencmd = vcgencmd if vcgencmd is not None else shutil.which("vcgencmd")
        self._nmcli = nmcli if nmcli is not None else shutil.which("nmcli")
        self._run = run
        self._metered_override = metered
        self._metered = bool(metered)
        self._metered_at = -1e9
        self._throttle_at = -1e9
        self._throttle: pi.Throttle | None = None
        self._rapl_last: tuple[float, list[rapl.Counter]] | None = None
        self.model = pi.board_model(self.root)
        self.kind = pi.device_kind(self.model)
        self._jetson = jetson.is_jetson(self.root)
        self._pmic = bool(self._vcgencmd) and self.kind == "pi5" and self._pmic_power() is not None

    def capabilities(self) -> Capabilities:
        from ..profiles import PROFILES

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
            self._throttle = pi.parse_throttled(self._run([self._vcgencmd, "get_throttled"]))
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
                    bat = battery.BatteryReading(pi.ups_battery_level(ups.bus_v), ups.current_a > 0, ups.power_w)
        if power is None and self._pmic:
            power = self._pmic_power()
        if power is None:
            power = self._rapl_power(now)
        if power is None and bat is not None and not bat.charging:
            power = bat.power_w
        freq, _ = cpu.cpu_freq_mhz(self.root)
        return Reading(
            free_memory_bytes=int(mem.available), cpu_load=round(load, 3), cpu_freq_mhz=freq,
            temperature_c=thermal.cpu_temperature(zones), throttled=throttled,
            battery_level=bat.level if bat else None, charging=bat.charging if bat else False,
            power_w=power, metered=self._read_metered(now))

    # ------------------------------------------------------------ links and power

    def _read_metered(self, now: float) -> bool:
        if self._metered_override is not None:
            return self._metered_override
        if self._nmcli and now - self._metered_at >= _NMCLI_EVERY_S:
            self._metered_at = now
            iface = network.default_interface(self.root)
            out = self._run([self._nmcli, "-t", "-f", "GENERAL.METERED", "dev", "show", iface]) if iface else None
            self._metered = network.metered(out)
        return self._metered

    def _pmic_power(self) -> float | None:
        return pi.pmic_power_w(self._run([self._vcgencmd, "pmic_read_adc"])) if self._vcgencmd else None

    def _rapl_uj(self) -> list[rapl.Counter]:
        return rapl.domains(rapl.packages(self.root))

    def _rapl_power(self, now: float) -> float | None:
        """Mean package power since the previous read (None on the first read or without RAPL)."""
        counters = self._rapl_uj()
        if not counters:
            return None
        last, self._rapl_last = self._rapl_last, (now, counters)
        if last is None or now <= last[0] or [c.name for c in last[1]] != [c.name for c in counters]:
            return None
        uj = sum(rapl.delta_uj(a.energy_uj, b.energy_uj, b.max_energy_range_uj)
                 for a, b in zip(last[1], counters))
        return uj / 1e6 / (now - last[0])

    def power_source(self) -> str | None:
        """The meter that measures this board's energy, best first; None: figures are modelled."""
        if self._jetson and jetson.rails(self.root):
            return "ina3221"
        if self._pmic:
            return "pmic"
        if self._rapl_uj():
            return "rapl"
        if pi.ina219(self.root) is not None:
            return "ina219"
        bat = battery.power_supply(self.root)
        if bat is not None and not bat.charging and bat.power_w is not None:
            return "battery"  # while it discharges, the battery's draw is the board's
        return None

    def _power_now(self, source: str) -> float | None:
        if source == "ina3221":
            return jetson.total_power_w(jetson.rails(self.root))
        if source == "pmic":
            return self._pmic_power()
        if source == "ina219":
            ups = pi.ina219(self.root)
            return ups.power_w if ups is not None else None
        bat = battery.power_supply(self.root)
        return bat.power_w if bat is not None and not bat.charging else None

    def measure_energy(self, run_batch: Callable[[int], None], n: int) -> energy.EnergyFigure | None:
        """Joules per inference of ``run_batch(n)`` from this board's meter; None without one.

        A counter (RAPL) is read around the batch; a power rail is sampled as the batch starts
        and every 50 ms while it runs.
        """
        source = self.power_source()
        if source is None or n < 1:
            return None
        if source == "rapl":
            before = self._rapl_uj()
            t0 = time.perf_counter()
            run_batch(n)
            after = self._rapl_uj()
            if [c.name for c in before] != [c.name for c in after] or time.perf_counter() <= t0:
                return None
            uj = sum(rapl.delta_uj(a.energy_uj, b.energy_uj, b.max_energy_range_uj)
                     for a, b in zip(before, after))
            return energy.from_counter(uj, n)
        samples: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while True:
                w = self._power_now(source)
                if w is not None:
                    samples.append(w)
                if done.wait(_SAMPLE_EVERY_S):
                    return

        sampler = threading.Thread(target=sample, name="energy-sampler", daemon=True)
        t0 = time.perf_counter()
        sampler.start()
        try:
            run_batch(n)
        finally:
            elapsed = time.perf_counter() - t0
            done.set()
            sampler.join(timeout=5.0)
        return energy.from_power(list(samples), elapsed, n, source)


def _capacity_wh(root: Path) -> float | None:
    from ._sysfs import glob_dirs, read_int, read_text

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
