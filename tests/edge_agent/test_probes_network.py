"""Metered links and thermal throttling on recorded outputs, through to the state advert."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from edge_agent.advertiser import Advertiser, Snapshot
from edge_agent.probes import network
from edge_agent.probes.live import LiveProbe
from edge_agent.runner import _yes_no

FIX = Path(__file__).parent / "fixtures"


class Recorded:
    """Answers probe commands from a board's recorded outputs; remembers what was asked."""

    def __init__(self, board: str) -> None:
        self.board = board
        self.asked: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str | None:
        self.asked.append(list(argv))
        nmcli = argv[0].endswith("nmcli")
        name = f"nmcli_general_metered_{argv[-1]}" if nmcli else "_".join(["vcgencmd", *argv[1:]])
        path = FIX / self.board / f"{name}.txt"
        return path.read_text() if path.is_file() else None


@pytest.mark.parametrize("text, want", [
    ("GENERAL.METERED:yes (guessed)\n", True),
    ("GENERAL.METERED:yes\n", True),
    ("GENERAL.METERED:no (guessed)\n", False),
    ("GENERAL.METERED:no\n", False),
    ("GENERAL.METERED:unknown\n", None),
    ("GENERAL.METERED:                          yes (guessed)\n", True),   # plain (not -t) output
    ("Error: Device 'wlan9' not found.\n", None),
    ("", None), (None, None),
])
def test_parse_nmcli_metered(text: str | None, want: bool | None) -> None:
    assert network.parse_nmcli_metered(text) is want


@pytest.mark.parametrize("board, iface", [("laptop", "wlp0s20f3"), ("pi5", "eth0"), ("orin", None)])
def test_default_route_interface(board: str, iface: str | None) -> None:
    # laptop: Wi-Fi (metric 600) wins over a USB Ethernet dongle (20100); docker0 is no default route
    assert network.default_interface(FIX / board) == iface


def test_override_beats_network_manager() -> None:
    assert network.metered("GENERAL.METERED:no\n", override=True)
    assert not network.metered("GENERAL.METERED:yes\n", override=False)
    assert not network.metered("GENERAL.METERED:unknown\n")  # unknown counts as unmetered


def test_laptop_on_a_phone_hotspot_advertises_metered() -> None:
    run = Recorded("laptop")
    probe = LiveProbe(FIX / "laptop", vcgencmd="", nmcli="/usr/bin/nmcli", run=run)
    r = probe.read(0.0)
    assert r.metered
    assert run.asked == [["/usr/bin/nmcli", "-t", "-f", "GENERAL.METERED", "dev", "show", "wlp0s20f3"]]
    probe.read(5.0)
    assert len(run.asked) == 1  # NetworkManager is asked every 30 s, not every probe
    st = Advertiser("lap").state(Snapshot(r), epoch=1, seq=2)
    assert st.metered and st.battery_level == 0.76 and not st.charging


def test_pi5_on_ethernet_is_unmetered_unless_the_owner_says() -> None:
    assert not LiveProbe(FIX / "pi5", vcgencmd="", nmcli="nmcli", run=Recorded("pi5")).read(0.0).metered
    run = Recorded("pi5")
    probe = LiveProbe(FIX / "pi5", vcgencmd="", nmcli="nmcli", metered=True, run=run)
    assert probe.read(0.0).metered and run.asked == []


def test_no_network_manager_means_unmetered() -> None:
    assert not LiveProbe(FIX / "laptop", vcgencmd="", nmcli="", run=Recorded("laptop")).read(0.0).metered


@pytest.mark.parametrize("value, want", [("yes", True), ("1", True), ("No", False), ("off", False),
                                         ("", None), (None, None), ("maybe", None)])
def test_environment_override(value: str | None, want: bool | None) -> None:
    assert _yes_no(value) is want


def test_pi4_throttling_from_recorded_vcgencmd_reaches_the_advert() -> None:
    run = Recorded("pi4")
    r = LiveProbe(FIX / "pi4", vcgencmd="/usr/bin/vcgencmd", nmcli="", run=run).read(0.0)
    assert ["/usr/bin/vcgencmd", "get_throttled"] in run.asked
    assert r.throttled  # 0x50005: under-voltage and throttled now
    assert Advertiser("pi4").state(Snapshot(r), epoch=1, seq=2).throttled
    assert not LiveProbe(FIX / "pi5", vcgencmd="vcgencmd", nmcli="", run=Recorded("pi5")).read(0.0).throttled


def test_thermal_zone_over_its_passive_trip_throttles(tmp_path: Path) -> None:
    zone = tmp_path / "sys/class/thermal/thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("cpu-thermal\n")
    (zone / "temp").write_text("86200\n")
    (zone / "trip_point_0_type").write_text("passive\n")
    (zone / "trip_point_0_temp").write_text("85000\n")
    r = LiveProbe(tmp_path, vcgencmd="", nmcli="").read(0.0)
    assert r.throttled and r.temperature_c == pytest.approx(86.2)


def test_a_link_turning_metered_is_advertised_at_once() -> None:
    """The owner moves the laptop from home Wi-Fi to a phone hotspot: a state goes out now, not in 10 s."""
    adv = Advertiser("lap")
    home = LiveProbe(FIX / "laptop", vcgencmd="", nmcli="", metered=False).read(0.0)
    hotspot = LiveProbe(FIX / "laptop", vcgencmd="", nmcli="nmcli", run=Recorded("laptop")).read(0.0)
    assert adv.tick(Snapshot(home), 0.0) == "first"
    assert adv.tick(Snapshot(home), 1.0) is None
    assert adv.tick(Snapshot(hotspot), 2.0) == "metered changed"
