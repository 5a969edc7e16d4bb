"""Cross-device selection: only charging, unmetered, idle, unthrottled devices train, each with its reason.

The devices' figures come from the probe over recorded board trees (a laptop on a phone hotspot,
discharging; a Pi 4 whose vcgencmd reports throttling; an Orin on mains), through the agent's
state advert and the fog's registry summaries, to the coordinator's selection: the same path a
real round takes, without the processes.
"""
from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from cloud_coordinator.selection import (
    BUSY,
    LOW_BATTERY,
    METERED,
    NOT_CHARGING,
    SELECTED,
    THROTTLED,
    SelectionPolicy,
    explain,
    explain_devices,
    select_clients,
)
from edge_agent.advertiser import Advertiser, Snapshot
from edge_agent.probes.live import LiveProbe
from edge_agent.readings import Reading
from fog_broker.registry import Registry, RegistryConfig
from runtime.errors import LocalViolation
from runtime.messages import DeviceBirth, DeviceSummary, FleetSummary

FIX = Path(__file__).parents[1] / "edge_agent" / "fixtures"
CROSS = SelectionPolicy.cross_device()


def _fleet(*devs: DeviceSummary) -> FleetSummary:
    return FleetSummary("fog-a", "site-a", 100.0, tuple(devs))


@pytest.mark.parametrize("dev, want", [
    (DeviceSummary("d", True), SELECTED),                                          # mains powered
    (DeviceSummary("d", True, battery_level=0.9, charging=True), SELECTED),
    (DeviceSummary("d", True, battery_level=0.9), NOT_CHARGING),                   # full, but draining
    (DeviceSummary("d", True, battery_level=0.1), LOW_BATTERY),
    (DeviceSummary("d", True, metered=True, battery_level=0.9, charging=True), METERED),
    (DeviceSummary("d", True, throttled=True), THROTTLED),
    (DeviceSummary("d", True, cpu_load=0.9), BUSY),                                # serving, or in use
    (DeviceSummary("d", True, cpu_load=0.2), SELECTED),
    (DeviceSummary("d", True, cpu_load=None), SELECTED),                           # an older fog: unknown
])
def test_cross_device_verdicts(dev: DeviceSummary, want: str) -> None:
    sel = select_clients([_fleet(dev)], 100.0, CROSS, random.Random(0))
    assert sel.reasons == {"d": want}


def test_default_policy_is_unchanged() -> None:
    """A discharging, busy device above the floor still trains under the default policy."""
    dev = DeviceSummary("d", True, battery_level=0.9, cpu_load=3.0)
    assert select_clients([_fleet(dev)], 100.0, SelectionPolicy(), random.Random(0)).selected == ("d",)
    with pytest.raises(LocalViolation):
        SelectionPolicy(max_cpu_load=-1.0)


def _birth(dev: str) -> DeviceBirth:
    return DeviceBirth(device_id=dev, epoch=1, seq=1, site="s", public_key=bytes(32), flops=1e9,
                       memory_bytes=1_000_000, uplink_bps=1e8, downlink_bps=1e8, rtt_s=0.001,
                       power_active_w=5.0, power_idle_w=2.0, state_interval_s=10.0)


def _recorded(board: str) -> Callable[[Sequence[str]], str | None]:
    def run(argv: Sequence[str]) -> str | None:
        name = (f"nmcli_general_metered_{argv[-1]}" if argv[0].endswith("nmcli")
                else "_".join(["vcgencmd", *argv[1:]]))
        path = FIX / board / f"{name}.txt"
        return path.read_text() if path.is_file() else None
    return run


def test_board_readings_through_the_fog_to_the_coordinator(tmp_path: Path) -> None:
    charging = tmp_path / "laptop-charging"
    shutil.copytree(FIX / "laptop", charging)
    (charging / "sys/class/power_supply/BAT0/status").write_text("Charging\n")
    (charging / "sys/class/power_supply/AC/online").write_text("1\n")
    boards = {  # device id -> (tree, recorded outputs of, nmcli path, operator's metered override)
        "laptop-hotspot": (FIX / "laptop", "laptop", "nmcli", None),      # metered and discharging
        "laptop-home": (charging, "laptop", "", False),                   # charging, unmetered
        "laptop-hotspot-charging": (charging, "laptop", "nmcli", None),   # charging, but metered
        "pi4": (FIX / "pi4", "pi4", "", None),                            # vcgencmd: throttled
        "orin": (FIX / "orin", "orin", "", None),                         # mains, idle
    }
    reg = Registry(RegistryConfig(battery_floor=0.3))
    for dev, (root, rec, nmcli, metered) in boards.items():
        probe = LiveProbe(root, vcgencmd="vcgencmd", nmcli=nmcli, metered=metered, run=_recorded(rec))
        reading = probe.read(0.0)
        reg.handle(_birth(dev), 0.0)
        reg.handle(Advertiser(dev).state(Snapshot(reading), epoch=1, seq=2), 0.1)
    fleet = FleetSummary("fog-a", "site-a", 100.0, reg.summaries())
    # idle is judged on a fixed load here: the probe's load is this test machine's
    fleet = FleetSummary(fleet.fog_id, fleet.site, fleet.timestamp,
                         tuple(_with_load(d, 0.1) for d in fleet.devices))
    sel = select_clients([fleet], 100.0, CROSS, random.Random(0))
    assert sel.reasons == {
        "laptop-hotspot": METERED, "laptop-home": SELECTED, "laptop-hotspot-charging": METERED,
        "pi4": THROTTLED, "orin": SELECTED}
    assert sel.selected == ("laptop-home", "orin")
    assert explain(sel) == "2/5 devices selected: 2 metered link, 1 throttled"
    assert explain_devices(sel) == ("laptop-home: selected; laptop-hotspot: metered link; "
                                    "laptop-hotspot-charging: metered link; orin: selected; pi4: throttled")
    # the owner says the hotspot is fine: the laptop is still not charging, and says so
    unmetered = [_with_load(d, 0.1) if d.device_id != "laptop-hotspot" else
                 _with_load(_unmetered(d), 0.1) for d in fleet.devices]
    sel = select_clients([_fleet(*unmetered)], 100.0, CROSS, random.Random(0))
    assert sel.reasons["laptop-hotspot"] == NOT_CHARGING


def _with_load(d: DeviceSummary, load: float) -> DeviceSummary:
    return DeviceSummary(d.device_id, d.alive, d.battery_level, d.charging, d.throttled, d.metered, d.power_w,
                         d.fit_for_training, d.reason, d.flwr_node_id, cpu_load=load)


def _unmetered(d: DeviceSummary) -> DeviceSummary:
    return DeviceSummary(d.device_id, d.alive, d.battery_level, d.charging, d.throttled, False, d.power_w,
                         d.fit_for_training, d.reason, d.flwr_node_id, d.cpu_load)


def test_the_fog_passes_the_load_on() -> None:
    reg = Registry()
    reg.handle(_birth("d"), 0.0)
    reg.handle(Advertiser("d").state(Snapshot(_reading(cpu_load=0.75)), epoch=1, seq=2), 0.1)
    (s,) = reg.summaries()
    assert s.cpu_load == 0.75
    sel = select_clients([_fleet(s)], 100.0, CROSS, random.Random(0))
    assert sel.reasons == {"d": BUSY}


def _reading(cpu_load: float) -> Reading:
    return Reading(free_memory_bytes=1_000_000, cpu_load=cpu_load)


def test_the_coordinator_selects_cross_device_and_reports_why_per_device(tmp_path: Path) -> None:
    """Board readings -> the fog's signed summary -> RobustStrategy under ``selection="cross-device"``:
    the metered and the discharging laptop do not train, and report.json, progress.json and the
    status line name each device's reason."""
    import json
    import time

    import numpy as np
    from flwr.app import Array, ArrayRecord

    from cloud_coordinator.selection import selection_line
    from cloud_coordinator.settings import Settings
    from cloud_coordinator.sites_cli import last_selection
    from cloud_coordinator.strategy import RobustStrategy, RoundConfig
    from cloud_coordinator.summaries import open_summary, store_summary
    from runtime.security import Identity, Signer

    from _grid import LocalGrid, pull_client

    charging = tmp_path / "laptop-charging"
    shutil.copytree(FIX / "laptop", charging)
    (charging / "sys/class/power_supply/BAT0/status").write_text("Charging\n")
    (charging / "sys/class/power_supply/AC/online").write_text("1\n")
    boards = {  # LocalGrid's node names -> (tree, recorded outputs of, nmcli path, metered override)
        "node-101": (FIX / "laptop", "laptop", "nmcli", None),     # on a phone hotspot, discharging
        "node-102": (FIX / "laptop", "laptop", "", False),         # home Wi-Fi, discharging
        "node-103": (charging, "laptop", "", False),               # home Wi-Fi, charging
        "node-104": (FIX / "orin", "orin", "", None),              # mains
        "node-105": (FIX / "pi4", "pi4", "", None),                # vcgencmd: throttled
    }
    reg = Registry(RegistryConfig(battery_floor=0.3))
    for dev, (root, rec, nmcli, metered) in boards.items():
        reading = LiveProbe(root, vcgencmd="vcgencmd", nmcli=nmcli, metered=metered, run=_recorded(rec)).read(0.0)
        reg.handle(_birth(dev), 0.0)
        reg.handle(Advertiser(dev).state(Snapshot(reading), epoch=1, seq=2), 0.1)
    fog = Identity.from_seed("fog-a", b"k")
    fleet = FleetSummary("fog-a", "lab", time.time(), tuple(_with_load(d, 0.1) for d in reg.summaries()))
    got = open_summary(Signer(fog, 1).seal_bytes(fleet, time.time()), "fog-a", fog.public_key_bytes, "lab")
    assert not isinstance(got, str)
    store_summary(tmp_path / "summaries", *got)

    work = tmp_path / "work"
    strategy = RobustStrategy("median", f=0,
                              rounds=RoundConfig(min_train_nodes=2, round_timeout=5.0, grace=0.0,
                                                 fraction_evaluate=0.0))
    strategy.apply_settings(Settings(str(work), summaries_dir=str(tmp_path / "summaries"),
                                     fog_keys={"fog-a": fog.public_key_bytes.hex()}, fog_sites={"fog-a": "lab"},
                                     selection="cross-device"))
    grid = LocalGrid()
    for i in range(6):  # node-106: no fog reports on it, so nothing says it cannot afford a round
        grid.add(pull_client(np.full(3, i, np.float32)))
    strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(3, np.float32))}), num_rounds=1)

    want = {"node-101": METERED, "node-102": NOT_CHARGING, "node-103": SELECTED, "node-104": SELECTED,
            "node-105": THROTTLED}
    (entry,) = json.loads((work / "report.json").read_text())["history"]
    assert entry["clients"] == ["node-103", "node-104", "node-106"]
    assert entry["selection"] == {"rule": "cross-device", "devices": want}
    progress = json.loads((work / "progress.json").read_text())["selection"]
    assert progress["devices"] == want and progress["summary"] == (
        "2/5 devices selected: 1 metered link, 1 on battery, not charging, 1 throttled")
    assert last_selection(work) == progress
    assert selection_line(progress) == (
        "selection (cross-device): node-101: metered link; node-102: on battery, not charging; "
        "node-103: selected; node-104: selected; node-105: throttled")


def test_the_default_rule_keeps_a_charging_device_below_the_floor_and_names_a_bad_rule() -> None:
    """battery-floor: the floor applies to a discharging device's charge only."""
    from cloud_coordinator.selection import DEFAULT_RULE, RULES, policy_named

    low = [DeviceSummary("charging", True, battery_level=0.05, charging=True),
           DeviceSummary("draining", True, battery_level=0.05)]
    sel = select_clients([_fleet(*low)], 100.0, policy_named(DEFAULT_RULE, 0.3), random.Random(0))
    assert sel.reasons == {"charging": SELECTED, "draining": LOW_BATTERY}
    assert policy_named("cross-device", 0.5) == SelectionPolicy.cross_device(battery_floor=0.5)
    assert RULES == ("battery-floor", "cross-device")
    with pytest.raises(LocalViolation, match=r"^selection must be one of battery-floor, cross-device, got 'greedy'$"):
        policy_named("greedy")


def test_the_coordinators_console_report_names_each_devices_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from cloud_coordinator.cli import _print_report

    doc = {"rounds": 1, "rounds_done": 1, "resumed_from": 0, "config_hash": "c", "history": [
        {"round": 1, "clients": ["b"], "accepted": ["b"],
         "selection": {"rule": "cross-device", "devices": {"a": METERED, "b": SELECTED, "c": NOT_CHARGING}}}]}
    _print_report(doc, Path("r"), SimpleNamespace(release_name="m", checkpoint_dirs=("w",), work_dir="w"))
    assert ("    selection (cross-device): a: metered link; b: selected; c: on battery, not charging"
            in capsys.readouterr().out.splitlines())


def test_one_sites_summary_never_overrides_anothers_device() -> None:
    """Issue 29: summaries were merged by bare device id, newest first, so a site naming another
    site's device in a newer summary decided for it (here: set it aside as metered)."""
    honest = FleetSummary("fog-a", "site-a", 100.0, (DeviceSummary("d", True), DeviceSummary("e", True)))
    liar = FleetSummary("fog-x", "site-x", 101.0, (DeviceSummary("d", True, metered=True),
                                                  DeviceSummary("e", True, metered=True)))
    sel = select_clients([honest, liar], 101.0, SelectionPolicy(), random.Random(0))
    # judged per site; no verdict under the bare ids the coordinator knows its nodes by
    assert sel.reasons == {"site-a/d": SELECTED, "site-x/d": METERED, "site-a/e": SELECTED, "site-x/e": METERED}
    assert "d" not in sel.reasons and "e" not in sel.reasons


def test_a_sites_own_fogs_report_newest_first() -> None:
    old = FleetSummary("fog-a", "site-a", 100.0, (DeviceSummary("d", True, metered=True),))
    new = FleetSummary("fog-b", "site-a", 101.0, (DeviceSummary("d", True),))
    assert select_clients([new, old], 101.0, SelectionPolicy(), random.Random(0)).reasons == {"d": SELECTED}
