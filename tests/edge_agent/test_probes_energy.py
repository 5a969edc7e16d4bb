"""Energy from the board: rails and counters on recorded trees, joules per inference measured or modelled.

The trees under fixtures/ are laid out as on the boards (Raspberry Pi 5, Jetson Orin Nano, an
x86 laptop with a battery and RAPL); command outputs are recorded text (vcgencmd_*.txt).
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from edge_agent.executor import Executor
from edge_agent.probes import battery, energy, pi, rapl
from edge_agent.probes.live import LiveProbe
from edge_agent.testing import tiny_chain
from runtime.messages import PartitionStatus
from runtime.relay import Sealer
from runtime.security import Identity, sha256_hex
from runtime.topics import Topics

FIX = Path(__file__).parent / "fixtures"
PMIC = (FIX / "pi5/vcgencmd_pmic_read_adc.txt").read_text()


def recorded(board: str) -> object:
    """A command runner answering from a board's recorded outputs (None: not recorded)."""

    def run(argv: Sequence[str]) -> str | None:
        name = "_".join(["vcgencmd" if "vcgencmd" in argv[0] else Path(argv[0]).name, *argv[1:]])
        if argv[0].endswith("nmcli"):
            name = f"nmcli_general_metered_{argv[-1]}"
        path = FIX / board / f"{name}.txt"
        return path.read_text() if path.is_file() else None

    return run


def busy(seconds: float) -> None:
    """Work, not waiting: the batch an energy meter measures."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# ------------------------------------------------------------------ Raspberry Pi 5 PMIC


def test_pi5_pmic_rails_from_recorded_output() -> None:
    amps, volts = pi.parse_pmic_adc(PMIC)
    assert len(amps) == 12 and len(volts) == 14
    assert "EXT5V" in volts and "EXT5V" not in amps  # a voltage-only rail is not a power reading
    rails = pi.pmic_rails_w(PMIC)
    assert set(rails) == set(amps)
    assert rails["VDD_CORE"] == pytest.approx(0.66777 * 0.724386)
    assert rails["DDR_VDDQ"] == 0.0
    assert pi.pmic_power_w(PMIC) == pytest.approx(sum(a * volts[r] for r, a in amps.items()))
    assert pi.pmic_power_w(PMIC) == pytest.approx(1.6258, abs=1e-4)


@pytest.mark.parametrize("text", [None, "", "error=2 error_msg=\"Invalid command\"",
                                  "VDD_CORE_A current(7)=nanA\nVDD_CORE_V volt(15)=0.7V",
                                  "VDD_CORE_A current(7)=-1A\nVDD_CORE_V volt(15)=0.7V"])
def test_pmic_garbage_is_no_reading(text: str | None) -> None:
    assert pi.pmic_power_w(text) is None


def test_live_probe_reads_the_pi5_pmic() -> None:
    probe = LiveProbe(FIX / "pi5", vcgencmd="/usr/bin/vcgencmd", nmcli="", run=recorded("pi5"))
    assert probe.power_source() == "pmic"
    r = probe.read(0.0)
    assert r.power_w == pytest.approx(pi.pmic_power_w(PMIC)) and not r.throttled
    t0 = time.perf_counter()
    fig = probe.measure_energy(lambda n: busy(0.02 * n), 3)
    elapsed = time.perf_counter() - t0
    assert fig is not None and fig.measured and fig.source == "pmic"
    # mean power x batch time / batch: 1.63 W over the batch's >= 60 ms, for 3 requests
    assert 0.06 <= fig.joules_per_inference * 3 / pi.pmic_power_w(PMIC) <= elapsed


def test_a_pi4_has_no_pmic() -> None:
    probe = LiveProbe(FIX / "pi4", vcgencmd="/usr/bin/vcgencmd", nmcli="", run=recorded("pi4"))
    assert probe.power_source() == "ina219"  # its UPS HAT's meter instead


# ------------------------------------------------------------------ Jetson Orin Nano INA3221


def test_orin_energy_from_its_ina3221_rails() -> None:
    probe = LiveProbe(FIX / "orin", vcgencmd="", nmcli="")
    assert probe.power_source() == "ina3221"
    t0 = time.perf_counter()
    fig = probe.measure_energy(lambda n: busy(0.01 * n), 5)
    elapsed = time.perf_counter() - t0
    assert fig is not None and fig.measured and fig.source == "ina3221"
    # VDD_IN = 6.512 W (5.056 V x 1.288 A) for the whole batch
    assert 6.512 * 0.05 / 5 <= fig.joules_per_inference <= 6.512 * elapsed / 5 + 1e-9


# ------------------------------------------------------------------ Intel RAPL (x86 laptop)


def test_laptop_rapl_domains_prefer_psys() -> None:
    counters = rapl.packages(FIX / "laptop")
    assert [c.name for c in counters] == ["package-0", "psys"]  # subzones (core, uncore) are parts
    assert [c.name for c in rapl.domains(counters)] == ["psys"]
    assert rapl.domains([c for c in counters if c.name != "psys"])[0].energy_uj == 48219531245


@pytest.mark.parametrize("before, after, top, delta", [
    (100, 250, 1000, 150),
    (900, 50, 1000, 150),       # wrapped once at max_energy_range_uj
    (262143328000, 1000, 262143328850, 1850),
    (5, 5, 1000, 0),
])
def test_rapl_wrap_around(before: int, after: int, top: int, delta: int) -> None:
    assert rapl.delta_uj(before, after, top) == delta


def _writable_laptop(tmp_path: Path) -> Path:
    root = tmp_path / "laptop"
    shutil.copytree(FIX / "laptop", root)
    return root


def test_rapl_counter_measures_a_batch_across_a_wrap(tmp_path: Path) -> None:
    root = _writable_laptop(tmp_path)
    psys = root / "sys/class/powercap/intel-rapl:1"
    top = int((psys / "max_energy_range_uj").read_text())
    (psys / "energy_uj").write_text(f"{top - 2_000_000}\n")

    def batch(n: int) -> None:  # the counter moves 7 J while the batch runs, wrapping past its range
        busy(0.001 * n)
        (psys / "energy_uj").write_text("5000000\n")

    probe = LiveProbe(root, vcgencmd="", nmcli="")
    assert probe.power_source() == "rapl"
    fig = probe.measure_energy(batch, 10)
    assert fig == energy.EnergyFigure(0.7, True, "rapl")


def test_rapl_power_between_two_reads(tmp_path: Path) -> None:
    root = _writable_laptop(tmp_path)
    psys = root / "sys/class/powercap/intel-rapl:1/energy_uj"
    probe = LiveProbe(root, vcgencmd="", nmcli="")
    first = probe.read(10.0)
    assert first.power_w == pytest.approx(9.871)  # no previous counter yet: the battery's draw
    psys.write_text(str(int(psys.read_text()) + 24_000_000))
    assert probe.read(12.0).power_w == pytest.approx(12.0)  # 24 J in 2 s


def test_a_counter_that_does_not_move_measures_nothing(tmp_path: Path) -> None:
    probe = LiveProbe(_writable_laptop(tmp_path), vcgencmd="", nmcli="")
    assert probe.measure_energy(lambda n: None, 5) is None  # the fixture's counters are frozen


# ------------------------------------------------------------------ battery and charging


def _battery_tree(tmp_path: Path, status: str, online: int) -> Path:
    root = _writable_laptop(tmp_path)
    shutil.rmtree(root / "sys/class/powercap")
    ps = root / "sys/class/power_supply"
    (ps / "BAT0/status").write_text(f"{status}\n")
    (ps / "AC/online").write_text(f"{online}\n")
    return root


def test_discharging_battery_is_the_meter(tmp_path: Path) -> None:
    probe = LiveProbe(_battery_tree(tmp_path, "Discharging", 0), vcgencmd="", nmcli="")
    assert probe.power_source() == "battery"
    fig = probe.measure_energy(lambda n: busy(0.005 * n), 4)
    assert fig is not None and fig.source == "battery" and fig.joules_per_inference > 0
    r = probe.read(0.0)
    assert (r.battery_level, r.charging, r.power_w) == (0.76, False, pytest.approx(9.871))


def test_charging_battery_is_not_a_meter(tmp_path: Path) -> None:
    """power_now while charging is the charger's, not the board's draw: the figure stays modelled."""
    probe = LiveProbe(_battery_tree(tmp_path, "Charging", 1), vcgencmd="", nmcli="")
    assert probe.power_source() is None
    assert probe.measure_energy(lambda n: None, 5) is None
    r = probe.read(0.0)
    assert r.charging and r.power_w is None
    b = battery.power_supply(probe.root)
    assert b is not None and b.charging and b.level == 0.76


# ------------------------------------------------------------------ the pure figures


def test_energy_figures() -> None:
    assert energy.batch_size(0.002) == 500
    assert energy.batch_size(5.0) == 5 and energy.batch_size(1e-6) == 1000 and energy.batch_size(0.0) == 5
    assert energy.from_counter(0, 10) is None and energy.from_counter(3_000_000, 0) is None
    assert energy.from_power([], 1.0, 5, "pmic") is None
    assert energy.from_power([float("nan"), 4.0, 6.0], 2.0, 4, "ina3221") == energy.EnergyFigure(2.5, True, "ina3221")
    assert energy.modelled(7.0, 0.01) == energy.EnergyFigure(0.07, False, "model")
    with pytest.raises(ValueError):
        energy.EnergyFigure(-1.0, True, "rapl")


# ------------------------------------------------------------------ the executor reports it


def _executor(probe: LiveProbe | None, power_active_w: float = 8.0) -> Executor:
    ident = Identity.generate("d0")
    ex = Executor("d0", Topics("s1"), lambda t, p: None, Sealer(ident), intra_op_threads=1)
    ex.power_active_w = power_active_w
    ex.measure_energy = probe.measure_energy if probe is not None else None
    return ex


def _status(ex: Executor) -> PartitionStatus:
    art = tiny_chain().parts[0]
    ex.load(("wl", 1, 0, 0), sha256_hex(art), art, 1000)
    (st,) = ex.statuses()
    return st


def test_partition_energy_measured_on_the_orin_rails() -> None:
    t0 = time.perf_counter()
    st = _status(_executor(LiveProbe(FIX / "orin", vcgencmd="", nmcli="")))
    load_s = time.perf_counter() - t0
    assert st.energy_measured and st.calib_s > 0
    # a batch of >= 5 requests (about a second) at 6.512 W: that power over one request's time in
    # the batch, which is no shorter than half the calibrated time and fits inside the load
    assert 6.512 * st.calib_s * 0.5 <= st.joules_per_inference <= 6.512 * load_s / 5


def test_partition_energy_modelled_without_rails() -> None:
    st = _status(_executor(LiveProbe(FIX / "pi5", vcgencmd="", nmcli=""), power_active_w=8.0))
    assert not st.energy_measured
    assert st.joules_per_inference == pytest.approx(8.0 * st.calib_s, abs=8.0 * 5e-7)  # calib_s is rounded to 1 us
    st = _status(_executor(None, power_active_w=8.0))
    assert not st.energy_measured
