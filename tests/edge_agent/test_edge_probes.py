"""Probe parsers on recorded sysfs trees and command output (fixtures/)."""
from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.probes import battery, cpu, jetson, pi, providers, thermal
from edge_agent.probes.live import LiveProbe, arch_label

FIX = Path(__file__).parent / "fixtures"


def _vcgencmd(board: str) -> str:
    return (FIX / board / "vcgencmd_get_throttled.txt").read_text()


@pytest.mark.parametrize("board, total, avail, ncpu, cur_mhz, max_mhz", [
    ("pi4", 3884308 * 1024, 3263116 * 1024, 4, 1500.0, 1800.0),
    ("pi5", 8245360 * 1024, 7602848 * 1024, 4, 1950.0, 2400.0),
    ("orin", 7460344 * 1024, 6180744 * 1024, 6, 1120.0, 1510.4),
    ("laptop", 16119564 * 1024, 10862104 * 1024, 8, 1900.0, 4700.0),
])
def test_cpu_and_memory(board: str, total: int, avail: int, ncpu: int, cur_mhz: float, max_mhz: float) -> None:
    root = FIX / board
    assert cpu.meminfo(root) == (total, avail)
    assert cpu.cpu_count(root) == ncpu
    cur, top = cpu.cpu_freq_mhz(root)
    assert cur == pytest.approx(cur_mhz, rel=1e-3)
    assert top == pytest.approx(max_mhz)
    assert cpu.parse_loadavg((root / "proc/loadavg").read_text()) > 0


@pytest.mark.parametrize("board, temp, throttled_by_trip", [
    ("pi4", 58.426, False),
    ("pi5", 63.15, False),          # "active" (fan) trips are not throttling
    ("orin", 49.0, False),          # hottest CPU/SoC zone (tj); cv* zones read -256 C: ignored
    ("laptop", 62.0, False),        # x86_pkg_temp; its passive trip of 0 means "unset"
    ("jetson-nano", 39.5, False),
])
def test_thermal(board: str, temp: float, throttled_by_trip: bool) -> None:
    zs = thermal.zones(FIX / board)
    assert thermal.cpu_temperature(zs) == pytest.approx(temp)
    assert thermal.over_passive_trip(zs) is throttled_by_trip


def test_thermal_passive_trip_reached() -> None:
    zs = [thermal.Zone("cpu-thermal", 99.5, 99.0), thermal.Zone("gpu-thermal", 50.0, None)]
    assert thermal.over_passive_trip(zs)
    assert thermal.cpu_temperature([]) is None


def test_laptop_zone_without_temp_is_skipped() -> None:
    types = [z.type for z in thermal.zones(FIX / "laptop")]
    assert "iwlwifi_1" not in types and "acpitz" in types


@pytest.mark.parametrize("text, raw, active, under_voltage, occurred", [
    ("throttled=0x50005\n", 0x50005, True, True, True),
    ("throttled=0x0\n", 0, False, False, False),
    ("throttled=0x50000", 0x50000, False, False, True),   # happened since boot, fine now
    ("throttled=0x8", 0x8, True, False, False),           # soft temperature limit
])
def test_parse_throttled(text: str, raw: int, active: bool, under_voltage: bool, occurred: bool) -> None:
    t = pi.parse_throttled(text)
    assert t is not None
    assert (t.raw, t.active, t.under_voltage, t.occurred) == (raw, active, under_voltage, occurred)


@pytest.mark.parametrize("text", [None, "", "error=1 error_msg=\"Command not registered\"", "throttled=zz"])
def test_parse_throttled_garbage(text: str | None) -> None:
    assert pi.parse_throttled(text) is None


def test_recorded_vcgencmd() -> None:
    pi4 = pi.parse_throttled(_vcgencmd("pi4"))
    pi5 = pi.parse_throttled(_vcgencmd("pi5"))
    assert pi4 is not None and pi4.active and pi4.throttled and pi4.under_voltage
    assert pi5 is not None and not pi5.active


@pytest.mark.parametrize("board, kind", [
    ("pi4", "pi4"), ("pi5", "pi5"), ("orin", "orin-nano"), ("jetson-nano", "jetson-nano"), ("laptop", ""),
])
def test_board_model(board: str, kind: str) -> None:
    assert pi.device_kind(pi.board_model(FIX / board)) == kind


def test_pi4_ups_hat_ina219() -> None:
    ups = pi.ina219(FIX / "pi4")
    assert ups is not None
    assert ups.bus_v == pytest.approx(7.892)
    assert ups.current_a == pytest.approx(-0.612)
    assert ups.power_w == pytest.approx(4.83)
    assert pi.ups_battery_level(ups.bus_v) == pytest.approx((3.946 - 3.0) / 1.2)
    assert pi.ina219(FIX / "pi5") is None


def test_orin_ina3221_hwmon() -> None:
    r = jetson.rails(FIX / "orin")
    assert set(r) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}
    assert r["VDD_IN"] == pytest.approx(5.056 * 1.288)
    assert jetson.total_power_w(r) == pytest.approx(6.512, abs=1e-3)
    assert jetson.is_jetson(FIX / "orin")


def test_jetson_nano_ina3221_iio() -> None:
    r = jetson.rails(FIX / "jetson-nano")
    assert r == pytest.approx({"POM_5V_IN": 3.012, "POM_5V_GPU": 0.079, "POM_5V_CPU": 0.397})
    assert jetson.total_power_w(r) == pytest.approx(3.012)


def test_no_jetson_rails_elsewhere() -> None:
    for board in ("pi4", "pi5", "laptop"):
        assert jetson.rails(FIX / board) == {}
        assert not jetson.is_jetson(FIX / board)
    assert jetson.total_power_w({}) is None
    assert jetson.total_power_w({"A": 1.0, "B": 2.0}) == 3.0


def test_laptop_battery_ignores_mouse() -> None:
    b = battery.power_supply(FIX / "laptop")
    assert b == battery.BatteryReading(0.76, False, pytest.approx(9.871))


@pytest.mark.parametrize("board", ["pi4", "pi5", "orin"])
def test_mains_powered_boards_have_no_battery(board: str) -> None:
    assert battery.power_supply(FIX / board) is None


def test_battery_energy_fallback_and_ac(tmp_path: Path) -> None:
    ps = tmp_path / "sys/class/power_supply"
    (ps / "BAT1").mkdir(parents=True)
    (ps / "BAT1/type").write_text("Battery\n")
    (ps / "BAT1/status").write_text("Not charging\n")
    (ps / "BAT1/energy_now").write_text("25000000\n")
    (ps / "BAT1/energy_full").write_text("50000000\n")
    (ps / "ADP1").mkdir()
    (ps / "ADP1/type").write_text("Mains\n")
    (ps / "ADP1/online").write_text("1\n")
    b = battery.power_supply(tmp_path)
    assert b is not None and b.level == 0.5 and b.charging  # on AC at a charge limit: not draining


def test_psutil_battery_conversion() -> None:
    class SB:
        percent = 42.0
        power_plugged = False
    assert battery.from_psutil(None) is None  # psutil: None means no battery (mains)
    assert battery.from_psutil(SB()) == battery.BatteryReading(0.42, False)


def test_providers_from_library_names() -> None:
    assert providers.from_library_names(["libonnxruntime_providers_shared.so"]) == ("CPUExecutionProvider",)
    jetpack = ["libonnxruntime_providers_cuda.so", "libonnxruntime_providers_tensorrt.so",
               "libonnxruntime_providers_shared.so", "onnxruntime_pybind11_state.so"]
    assert providers.from_library_names(jetpack) == (
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
    assert providers.best(["CPUExecutionProvider", "AzureExecutionProvider", "CUDAExecutionProvider"]) == [
        "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert "CPUExecutionProvider" in providers.installed()


@pytest.mark.parametrize("machine, label", [("x86_64", "amd64"), ("aarch64", "arm64"), ("armv7l", "arm")])
def test_arch_label(machine: str, label: str) -> None:
    assert arch_label(machine) == label


@pytest.mark.parametrize("board", ["pi4", "pi5", "orin", "jetson-nano", "laptop"])
def test_live_probe_over_fixture_root(board: str) -> None:
    """The live probe composes the parsers; memory/load come from psutil (this machine)."""
    probe = LiveProbe(FIX / board, vcgencmd="")
    caps = probe.capabilities()
    r = probe.read(0.0)
    assert caps.flops > 0 and caps.memory_bytes > 0 and r.free_memory_bytes > 0
    if board == "orin":
        assert r.power_w == pytest.approx(6.512, abs=1e-3) and caps.labels["accelerator"] == "cuda"
        assert caps.labels["device-model"] == "orin-nano" and "cuda" in caps.accelerators
    if board == "pi4":
        assert r.power_w == pytest.approx(4.83) and r.battery_level is not None and not r.charging
    if board == "laptop":
        assert r.battery_level == 0.76 and r.power_w == pytest.approx(9.871)
        assert caps.battery_capacity_wh == pytest.approx(50.16)
    if board == "pi5":
        assert r.battery_level is None and r.power_w is None
