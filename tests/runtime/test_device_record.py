"""Issue 19: one device record. ``runtime.devices.DeviceResources`` is declared once; the agent's
capabilities, the wire birth and the simulated profiles are it, and the scheduler's ``Device`` is
converted from it in one function, so a new device field is declared in one place."""
from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest

from edge_agent.advertiser import build_birth
from edge_agent.profiles import PROFILES, DeviceProfile
from edge_agent.readings import Capabilities
from edge_agent.simulated import SimulatedDevice
from fog_broker.placement.model import Device
from runtime import codec
from runtime._schema import to_wire
from runtime.devices import RESOURCE_RANGES, DeviceResources, OutOfRange, Taint, resource_fields
from runtime.messages import BIRTH_RANGES, DeviceBirth

KEY = bytes(32)
# The birth's wire keys before the record existed: the format must not change.
WIRE_KEYS = ["device_id", "epoch", "seq", "site", "public_key", "flops", "memory_bytes", "uplink_bps",
             "downlink_bps", "rtt_s", "power_active_w", "power_idle_w", "tx_j_per_byte", "rx_j_per_byte",
             "battery_capacity_wh", "labels", "taints", "accelerators", "providers", "cpu_count",
             "state_interval_s", "simulated", "agent_version", "session_key", "fog_session_key"]


def test_every_view_of_a_device_is_the_one_record() -> None:
    for view in (DeviceBirth, Capabilities, DeviceProfile, Device):
        assert issubclass(view, DeviceResources)
        names = {f.name for f in dataclasses.fields(view)}
        assert set(resource_fields()) <= names, view
    assert set(RESOURCE_RANGES) <= set(resource_fields()) and set(RESOURCE_RANGES) <= set(BIRTH_RANGES)
    # every scheduler figure that is a record figure is copied by the one conversion: distinct
    # in-range values in, the same values out (a field added to both but not copied fails here)
    shared = [f.name for f in dataclasses.fields(Device) if f.name in RESOURCE_RANGES]
    assert shared and set(shared) <= set(resource_fields())
    values = {}
    for i, name in enumerate(RESOURCE_RANGES):
        r = RESOURCE_RANGES[name]
        v = min(r.lo + (i + 1) * 1e-3 * (r.hi - r.lo) / len(RESOURCE_RANGES), r.hi)
        values[name] = int(v) if isinstance(r.lo, int) and isinstance(r.hi, int) else float(v)
    res = DeviceResources(**values)
    dev = Device.from_resources("x", res)
    assert {n: getattr(dev, n) for n in shared} == {n: values[n] for n in shared}


def test_the_birth_keeps_its_wire_format_and_positional_order() -> None:
    b = DeviceBirth("d", 1, 2, "s", KEY, 1e9, 1 << 20, 1e8, 1e8, 0.001, 5.0, 2.0, 4e-8, 4e-8, 20.0,
                    {"a": "b"}, (Taint("k", "v"),), ("cuda",), ("CPUExecutionProvider",), 4)
    assert [f.name for f in dataclasses.fields(DeviceBirth)] == WIRE_KEYS
    assert list(to_wire(b)) == WIRE_KEYS
    assert (b.flops, b.battery_capacity_wh, b.cpu_count, b.taints[0].key) == (1e9, 20.0, 4, "k")
    assert codec.decode(codec.encode(b)) == b
    assert not hasattr(b, "__dict__")  # still slotted: adverts arrive thousands a second


def test_a_probe_result_becomes_a_birth_and_a_scheduler_device_without_copying_fields() -> None:
    prof = PROFILES["laptop"]
    caps = SimulatedDevice(prof).capabilities()
    assert caps.resources() == prof.resources()  # the profile's record, figure for figure
    b = build_birth("lap-1", "s", caps, KEY, epoch=1, seq=0, labels={"zone": "z"},
                    taints=(Taint("edge"),), state_interval_s=5.0)
    assert b.resources().labels == {**prof.labels, "zone": "z", "site": "s"}
    assert {n: getattr(b, n) for n in RESOURCE_RANGES} == {n: getattr(prof, n) for n in RESOURCE_RANGES}
    dev = Device.from_resources("lap-1", codec.decode(codec.encode(b)), battery_level=0.5)
    assert dev.battery is not None and dev.battery.capacity_wh == prof.battery_capacity_wh
    assert dev.battery.level == 0.5 and dev.taints[0].key == "edge" and dev.providers == prof.providers
    assert Device.from_dict(dev.to_dict()) == dev
    assert Device.from_dict(prof.to_fleet_device("lap-1")).flops == prof.flops


def test_an_int_figure_is_that_float_and_a_bad_one_names_itself() -> None:
    caps = Capabilities(1, 1 << 20, 100, 100, 0, 5, 2)  # a probe's ints
    assert isinstance(caps.flops, float) and isinstance(caps.rtt_s, float)
    with pytest.raises(OutOfRange, match=r"Capabilities\.tx_j_per_byte=-1\.0"):
        Capabilities(1e9, 1, 1e8, 1e8, 0.0, 5.0, 2.0, tx_j_per_byte=-1.0)
    with pytest.raises(ValueError, match=r"profile pi4: .*cpu_count=0"):
        dataclasses.replace(PROFILES["pi4"], cpu_count=0)


def test_subcommands_are_registered_by_entry_point() -> None:
    """runtime.cli names no package: each one registers its subcommands (pyproject entry points)."""
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="fogline.commands")}
    assert {"agent", "fog", "cloud", "models", "sim", "bench"} <= set(eps)
    from runtime import cli

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert {"bench", "agent", "broker", "status", "coordinator", "sites", "place"} <= set(sub.choices)
