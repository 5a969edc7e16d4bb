"""Measured per-device segment times, execution-provider selectors and input shapes in placement.

Measured seconds (keyed by device id or device class) replace ``flops / device.flops``
on the devices they name; the exact optimiser, its dominance pruning, the reference
cost and the independent validator must all agree on that.
"""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from fog_broker.placement import (
    ChainProfile,
    DeviceTable,
    Fleet,
    SpecError,
    Workload,
    chain_cost,
    parse_workloads,
    schedule,
    solve_chain,
    validate_plan,
)
from fog_broker.placement.plugins import NO_PROVIDER, NodeView, ProviderFit

from placement_helpers import brute_force, dev, profile, random_instance

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def _wl(prof: ChainProfile, **kw: object) -> Workload:
    base: dict[str, object] = dict(name="w", source="src", sink="src", profile=prof)
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


def test_measured_times_override_flops() -> None:
    """By FLOPs 'fast' wins; measured, 'slow-on-paper' is ten times quicker: it must be chosen."""
    fast = dev("fast", flops=1e10, labels=(("device-class", "gw"),))
    paper = dev("paper", flops=1e8, labels=(("device-class", "orin"),))
    src = dev("src", flops=1e6, memory_bytes=0.0)
    prof = profile(3)
    fleet = Fleet((src, fast, paper))
    by_flops = schedule(fleet, [_wl(prof)]).result("w")
    assert {p.device for p in by_flops.replicas[0].partitions} == {"fast"}
    measured = prof.with_times({"orin": [1e-4, 1e-4, 1e-4]})
    plan = schedule(fleet, [_wl(measured)])
    rep = plan.result("w").replicas[0]
    assert [p.device for p in rep.partitions] == ["paper"]
    devices = {d.id: d for d in fleet.devices}
    assert rep.latency_s == pytest.approx(
        chain_cost(measured, rep.partitions, devices, "src", "src").latency_s)
    assert 3e-4 < rep.latency_s < 0.05  # by FLOPs it would be 3 s on "paper"
    assert validate_plan(plan, fleet, [_wl(measured)]) == []


def test_id_key_beats_class_key() -> None:
    d = dev("a", labels=(("device-model", "pi4"),))
    prof = profile(2).with_times({"pi4": [1.0, 1.0], "a": [0.5, 0.25]})
    assert prof.times_for(d) == (0.5, 0.25)
    assert prof.compute_s(0, 1, d) == 0.75
    assert prof.times_for(dev("b", labels=(("device-model", "pi4"),))) == (1.0, 1.0)
    assert prof.times_for(dev("c")) is None
    assert prof.compute_s(0, 1, dev("c", flops=1e9)) == pytest.approx(0.2)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("objective", ["latency", "energy"])
def test_exact_with_measured_times(seed: int, objective: str) -> None:
    """solve_chain equals brute force when some devices (by id or class) have measured times."""
    rng = random.Random(seed)
    devs, prof = random_instance(rng, 5, 4)
    classes = ["pi4", "orin"]
    devs = [d if i % 2 else replace(d, labels={**d.labels, "device-class": classes[i % 4 // 2]})
            for i, d in enumerate(devs)]
    times = {"pi4": [rng.uniform(1e-4, 0.2) for _ in prof.segments],
             devs[1].id: [rng.uniform(1e-4, 0.2) for _ in prof.segments]}
    prof = prof.with_times(times)
    table = DeviceTable.from_devices(devs)
    want = brute_force(devs, prof, devs[0].id, devs[-1].id, objective, None)
    for prune in (False, True):
        got = solve_chain(table, prof, 0, len(devs) - 1, objective=objective, prune=prune)
        if want is None:
            assert got is None
            continue
        assert got is not None and got.exact
        assert got.value == pytest.approx(want[0], rel=1e-9)


def test_pruning_keeps_the_optimum_with_measured_times() -> None:
    """Many copies of a few device kinds: dominance pruning on per-segment times loses nothing."""
    rng = random.Random(5)
    devs = []
    for i in range(60):
        kind = i % 3
        devs.append(dev(f"d{i}", flops=[1e9, 2e9, 4e9][kind] * rng.uniform(0.9, 1.1),
                        memory_bytes=rng.uniform(2e5, 1e6),
                        labels=(("device-class", ["a", "b", "c"][kind]),)))
    prof = profile(6, flops=2e8).with_times({"b": [0.05, 0.001, 0.2, 0.001, 0.05, 0.01]})
    table = DeviceTable.from_devices(devs)
    for objective in ("latency", "energy"):
        ref = solve_chain(table, prof, 0, 1, objective=objective, prune=False)
        got = solve_chain(table, prof, 0, 1, objective=objective, prune=True)
        assert ref is not None and got is not None
        assert got.value == pytest.approx(ref.value, rel=1e-9)


@pytest.mark.parametrize(("doc", "needle"), [
    ({"segment_times_s": {"pi4": [0.1]}}, "1 segment times for a chain of 2"),
    ({"segment_times_s": {"pi4": [0.1, -1.0]}}, "must be >= 0"),
    ({"segment_times_s": {"pi4": "fast"}}, "expected a list"),
    ({"input_shapes": {"x": [1, 0]}}, "must be >= 1"),
    ({"input_shapes": {"x": "1,3"}}, "expected a list"),
    ({"providers": "CUDA"}, "expected a list"),
])
def test_bad_workload_fields(doc: dict[str, object], needle: str) -> None:
    wl = {"name": "w", "source": "a", "sink": "a", "profile": profile(2).to_dict(), **doc}
    with pytest.raises(SpecError, match=needle) as info:
        parse_workloads({"workloads": [wl]})
    assert "\n" not in str(info.value)


def test_workload_json_round_trip() -> None:
    doc = {"name": "w", "source": "a", "sink": "a", "model": "m.onnx",
           "input_shapes": {"x": [1, 3, 48, 320]}, "providers": [CUDA],
           "segment_times_s": {"orin": [0.1, 0.2]}}
    (w,), _ = parse_workloads({"workloads": [doc]})
    assert w.input_shapes == (("x", (1, 3, 48, 320)),) and w.providers == (CUDA,)
    assert Workload.from_dict(w.to_dict()) == w
    placed = w.with_profile(profile(2))
    assert placed.profile is not None and dict(placed.profile.segment_times) == {"orin": (0.1, 0.2)}
    with pytest.raises(SpecError, match="2 times, the model's chain 3 segments"):
        w.with_profile(profile(3))
    inline = {"name": "v", "source": "a", "sink": "a", "profile": profile(2).to_dict(),
              "segment_times_s": {"a": [1.0, 2.0]}}
    (v,), _ = parse_workloads({"workloads": [inline]})
    assert v.profile is not None and v.profile.times_for(dev("a")) == (1.0, 2.0)
    assert ChainProfile.from_dict(v.profile.to_dict()) == v.profile


def test_provider_selector() -> None:
    gpu = dev("gpu", providers=(CUDA, CPU))
    cpu = dev("cpu", flops=1e11, providers=(CPU,))
    silent = dev("old")  # reported nothing: runs the CPU provider
    assert ProviderFit().filter(_wl(profile(1), providers=(CUDA,)), NodeView(gpu, 1e9)).ok
    st = ProviderFit().filter(_wl(profile(1), providers=(CUDA,)), NodeView(silent, 1e9))
    assert not st.ok and st.reasons == (NO_PROVIDER,)
    fleet = Fleet((gpu, cpu, silent))
    wl = _wl(profile(2), source="cpu", sink="cpu", providers=(CUDA,))
    plan = schedule(fleet, [wl])
    assert {p.device for p in plan.result("w").replicas[0].partitions} == {"gpu"}
    assert validate_plan(plan, fleet, [wl]) == []
    none = _wl(profile(2), source="cpu", sink="cpu", providers=("TensorrtExecutionProvider",))
    res = schedule(fleet, [none]).result("w")
    assert not res.placed
    assert res.reason_map["providers"] == ("3 devices offer none of the execution providers "
                                           "TensorrtExecutionProvider")


def test_device_providers_round_trip() -> None:
    d = {"id": "j", "flops": 1e9, "memory_bytes": 1e6, "uplink_bps": 1e6, "downlink_bps": 1e6,
         "providers": [CUDA, CPU], "labels": {"device-class": "orin"}}
    fleet = Fleet.from_dict({"devices": [d]})
    assert fleet.devices[0].providers == (CUDA, CPU)
    assert fleet.devices[0].device_class == "orin"
    assert Fleet.from_dict(fleet.to_dict()) == fleet
    assert "providers" not in Fleet((dev("x"),)).to_dict()["devices"][0]


def test_table_classes_drive_the_time_matrix() -> None:
    from fog_broker.placement.chain import _ProfileArrays

    devs = [dev("a", labels=(("device-class", "k"),)), dev("b", flops=2e9)]
    prof = profile(2, flops=1e8).with_times({"k": [0.3, 0.4]})
    T = _ProfileArrays.of(DeviceTable.from_devices(devs), prof).T
    assert T is not None
    assert np.allclose(T, [[0.3, 0.05], [0.4, 0.05]])
    assert _ProfileArrays.of(DeviceTable.from_devices(devs), profile(2)).T is None
