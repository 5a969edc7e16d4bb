"""Compressed cuts in the cost model: a workload whose cuts travel as float16 or int8 is charged
those bytes at each cut (the answer stays float32), so its plan's prediction is the link's."""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from fog_broker.placement import (
    DeviceTable,
    Fleet,
    PartitionPlacement,
    SpecError,
    Workload,
    chain_cost,
    schedule,
    solve_chain,
)
from fog_broker.placement.cost import stage_times

from placement_helpers import brute_force, dev, profile, random_instance


@pytest.mark.parametrize(("bound", "wire", "ratio"), [
    ({}, "float32", 1.0),
    ({"max_activation_error": 1e-3}, "float16", 0.5),
    ({"max_activation_error": 1e-5}, "float32", 1.0),   # below float16's rounding: no encoding
    ({"max_activation_error": 0.05}, "int8", 0.25),
    ({"min_top1_agreement": 0.99}, "int8", 0.25),
    ({"min_top1_agreement": 0.99, "max_activation_error": 1e-3}, "int8", 0.25),
    ({"min_top1_agreement": 0.99, "max_activation_error": 1e-5}, "float32", 1.0),
])
def test_the_bound_names_the_wire_the_profile_charges(bound: dict[str, float], wire: str,
                                                      ratio: float) -> None:
    w = Workload.from_dict({"name": "w", "source": "a", "sink": "a",
                            "profile": profile(3).to_dict(), **bound})
    assert w.cut_wire == wire and w.profile is not None and w.profile.wire_ratio == ratio
    segs = w.profile.segments
    assert w.profile.cut_bytes(0) == segs[0].out_bytes * ratio
    assert w.profile.cut_bytes(len(segs) - 1) == segs[-1].out_bytes  # the answer: float32
    # a model workload's profile, attached later, is charged the same way
    m = Workload("m", "a", "a", model="x.onnx", **bound).with_profile(profile(3))  # type: ignore[arg-type]
    assert m.profile is not None and m.profile.wire_ratio == ratio
    assert m.profile.with_times({"a": [0.1, 0.1, 0.1]}).wire_ratio == ratio


def test_a_wire_ratio_out_of_range_is_refused() -> None:
    with pytest.raises(SpecError, match="wire_ratio"):
        replace(profile(2), wire_ratio=0.0)


def _link_bound_plan(bound: dict[str, float]) -> tuple[Workload, float, list[tuple[str, float]]]:
    """Two workers on a 10 Mbit/s link, a 2-partition chain whose cut carries 1 MB in float32."""
    devs = [dev("cam", flops=1e8, memory_bytes=1e3, uplink_bps=1e9, downlink_bps=1e9,
                labels=(("role", "src"),)),
            *(dev(f"w{i}", flops=1e10, memory_bytes=1e9, uplink_bps=1e7, downlink_bps=1e9,
                  labels=(("role", "worker"),)) for i in range(2))]
    big = profile(4, flops=1e8, out=1e6, inp=1e3)
    prof = replace(big, segments=(*big.segments[:-1], replace(big.segments[-1], out_bytes=1e3)))
    w = Workload("w", "cam", "cam", objective="throughput", profile=prof, min_partitions=2,
                 max_partitions=2, selectors=(("role", "worker"),), **bound)  # type: ignore[arg-type]
    r = schedule(Fleet(tuple(devs)), [w]).result("w")
    assert r is not None
    rep = r.replicas[0]
    assert w.profile is not None
    stages = stage_times(w.profile, rep.partitions, {d.id: d for d in devs}, "cam", "cam")
    cc = chain_cost(w.profile, rep.partitions, {d.id: d for d in devs}, "cam", "cam")
    assert rep.bottleneck_s == pytest.approx(cc.bottleneck_s, rel=1e-9)
    return w, rep.bottleneck_s, stages


def test_the_plan_charges_the_cut_on_its_wire() -> None:
    _, f32, st32 = _link_bound_plan({})
    _, f16, st16 = _link_bound_plan({"max_activation_error": 1e-3})
    _, i8, st8 = _link_bound_plan({"min_top1_agreement": 0.99})
    cut = next(t for name, t in st32 if name.startswith("link w"))  # the link between the stages
    assert cut == pytest.approx(8 * 1e6 / 1e7)                      # 0.8 s: 1 MB at 10 Mbit/s
    assert f32 == pytest.approx(cut)
    assert f16 == pytest.approx(cut / 2)                              # float16: half the bytes
    assert i8 == pytest.approx(cut / 4)                               # int8: a quarter
    assert [n for n, _ in st16] == [n for n, _ in st32] == [n for n, _ in st8]


@pytest.mark.parametrize("seed", range(6))
def test_exact_against_brute_force_with_compressed_cuts(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(15):
        devs, prof = random_instance(rng, rng.randint(2, 5), rng.randint(1, 5))
        prof = replace(prof, wire_ratio=rng.choice([0.25, 0.5]))
        src, snk = rng.randrange(len(devs)), rng.randrange(len(devs))
        K = rng.choice([None, 2, 3])
        ids = [d.id for d in devs]
        for objective in ("throughput", "latency"):
            sol = solve_chain(DeviceTable.from_devices(devs), prof, src, snk, objective=objective,
                              max_partitions=K)
            bf = brute_force(devs, prof, ids[src], ids[snk], objective, K)
            if bf is None:
                assert sol is None
                continue
            assert sol is not None
            pl = [PartitionPlacement(f, last, ids[z]) for f, last, z in sol.parts]
            cc = chain_cost(prof, pl, {d.id: d for d in devs}, ids[src], ids[snk])
            assert cc.objective(objective) == pytest.approx(bf[0], rel=1e-9, abs=1e-15)
            assert np.isfinite(sol.value)
