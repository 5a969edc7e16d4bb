"""Dominance pruning keeps the optimum, and ``min_partitions`` is exact (brute force)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fog_broker.placement import (
    DeviceTable,
    Fleet,
    PartitionPlacement,
    SpecError,
    Workload,
    chain_cost,
    schedule,
    solve_chain,
    validate_plan,
)
from fog_broker.placement.chain import kept_devices

from placement_helpers import brute_force, dev, dominated_fleet, profile, random_instance


def _value(devs, prof, sol, src, snk, obj):  # type: ignore[no-untyped-def]
    ids = [d.id for d in devs]
    pl = [PartitionPlacement(f, last, ids[z]) for f, last, z in sol.parts]
    return chain_cost(prof, pl, {d.id: d for d in devs}, ids[src], ids[snk]).objective(obj)


def _solve_both(devs, prof, src, snk, obj, kmin, kmax, free):  # type: ignore[no-untyped-def]
    tab = DeviceTable.from_devices(devs)
    kw = dict(objective=obj, min_partitions=kmin, max_partitions=kmax, free=free)
    return (solve_chain(tab, prof, src, snk, prune=True, **kw),
            solve_chain(tab, prof, src, snk, prune=False, **kw))


@pytest.mark.parametrize("seed", range(10))
def test_pruned_equals_brute_force(seed: int) -> None:
    """Small dominated fleets, chains long enough that the once-per-chain rule matters."""
    rng = random.Random(1000 + seed)
    pruned_any = 0
    for _ in range(12):
        devs = dominated_fleet(rng, rng.randint(1, 2), rng.randint(1, 3))
        _, prof = random_instance(rng, 1, rng.randint(1, 4))
        n = len(prof.segments)
        kmax = rng.choice([None, 1, 2, 3])
        kmin = rng.randint(1, min(n, kmax or n))
        src, snk = rng.randrange(len(devs)), rng.randrange(len(devs))
        obj = rng.choice(["latency", "energy"])
        tab = DeviceTable.from_devices(devs)
        ok = np.ones(len(devs), dtype=bool)
        kept = kept_devices(tab, prof, obj, min(n, kmax or n), tab.memory, ok, (src, snk))
        pruned_any += int((~kept).sum())
        sol, _ = _solve_both(devs, prof, src, snk, obj, kmin, kmax, None)
        ids = [d.id for d in devs]
        bf = brute_force(devs, prof, ids[src], ids[snk], obj, kmax, min_partitions=kmin)
        if bf is None:
            assert sol is None
            continue
        assert sol is not None and sol.exact
        assert kmin <= len(sol.parts) <= min(n, kmax or n)
        assert all(kept[z] for _, _, z in sol.parts)
        assert _value(devs, prof, sol, src, snk, obj) == pytest.approx(bf[0], rel=1e-9, abs=1e-15)
    assert pruned_any > 0  # the instances do exercise pruning


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_base=st.integers(1, 5), copies=st.integers(1, 8),
       n_seg=st.integers(1, 6), obj=st.sampled_from(["latency", "energy"]),
       kmax=st.sampled_from([None, 1, 2, 3, 5]), tight=st.booleans())
def test_pruned_equals_unpruned(seed: int, n_base: int, copies: int, n_seg: int, obj: str,
                                kmax: int | None, tight: bool) -> None:
    """Bigger fleets than brute force can handle: the pruned and full solvers agree exactly."""
    rng = random.Random(seed)
    devs = dominated_fleet(rng, n_base, copies, tight=tight)
    _, prof = random_instance(rng, 1, n_seg)
    n = len(prof.segments)
    kmin = rng.randint(1, min(n, kmax or n))
    free = np.array([d.memory_bytes * rng.choice([1.0, 1.0, rng.uniform(0.3, 1.0)])
                     for d in devs])
    src, snk = rng.randrange(len(devs)), rng.randrange(len(devs))
    a, b = _solve_both(devs, prof, src, snk, obj, kmin, kmax, free)
    assert (a is None) == (b is None)
    if a is not None and b is not None and a.exact and b.exact:
        assert a.value == pytest.approx(b.value, rel=1e-9, abs=1e-15)
        assert _value(devs, prof, a, src, snk, obj) == pytest.approx(b.value, rel=1e-9,
                                                                      abs=1e-15)


def test_identical_devices_keep_enough_for_the_longest_chain() -> None:
    """Ties are broken by index: of 10 identical devices exactly P survive, and P suffice."""
    devs = [dev("src", memory_bytes=0.0)] + [dev(f"d{i}", memory_bytes=1.6e5) for i in range(10)]
    prof = profile(4)  # each segment needs 150 kB, so every chain has 4 partitions
    tab = DeviceTable.from_devices(devs)
    ok = np.ones(len(devs), dtype=bool)
    ok[0] = False
    kept = kept_devices(tab, prof, "latency", 4, tab.memory, ok, (0, 0))
    assert int(kept.sum()) == 4
    sol = solve_chain(tab, prof, 0, 0, prune=True)
    assert sol is not None and len(sol.parts) == 4


def test_source_and_sink_are_never_pruned() -> None:
    """A weak source that can host the whole model is kept: running there costs no transfer."""
    weak = dev("weak", flops=1e8, memory_bytes=1e9, uplink_bps=1e5, downlink_bps=1e5, rtt_s=0.1)
    strong = [dev(f"s{i}", flops=1e10, memory_bytes=1e9, uplink_bps=1e8, downlink_bps=1e8,
                  rtt_s=1e-4) for i in range(6)]
    devs = [weak, *strong]
    tab = DeviceTable.from_devices(devs)
    prof = profile(2, flops=1e3)
    ok = np.ones(len(devs), dtype=bool)
    assert not kept_devices(tab, prof, "latency", 2, tab.memory, ok)[0]
    assert kept_devices(tab, prof, "latency", 2, tab.memory, ok, (0, 0))[0]
    sol = solve_chain(tab, prof, 0, 0, prune=True)
    assert sol is not None and sol.parts == ((0, 1, 0),)


def test_memory_rounds_to_partition_sizes() -> None:
    """Free memory only matters up to the partitions it admits: more of it does not protect."""
    prof = profile(2)  # partitions need 150 kB (one segment) or 250 kB (both)
    big = dev("big", flops=2e9, memory_bytes=3e5)
    huge_slow = [dev(f"h{i}", flops=1e9, memory_bytes=1e9) for i in range(2)]
    devs = [dev("src", memory_bytes=0.0), big, dev("big2", flops=2e9, memory_bytes=3e5),
            *huge_slow]
    tab = DeviceTable.from_devices(devs)
    ok = np.ones(len(devs), dtype=bool)
    kept = kept_devices(tab, prof, "latency", 2, tab.memory, ok, (0, 0))
    assert not kept[3:].any()  # 1 GB buys nothing over 300 kB here; the slower copies go


# --- min_partitions --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_min_partitions_exact_against_brute_force(seed: int) -> None:
    rng = random.Random(500 + seed)
    for _ in range(15):
        devs, prof = random_instance(rng, rng.randint(2, 5), rng.randint(1, 5),
                                     tight=rng.random() < 0.5)
        n = len(prof.segments)
        kmax = rng.choice([None, None, n, rng.randint(1, n)])
        kmin = rng.randint(1, min(n, kmax or n))
        src, snk = rng.randrange(len(devs)), rng.randrange(len(devs))
        obj = rng.choice(["latency", "energy"])
        ids = [d.id for d in devs]
        free = {d.id: d.memory_bytes * rng.uniform(0.3, 1.0) for d in devs}
        farr = np.array([free[i] for i in ids])
        tab = DeviceTable.from_devices(devs)
        for prune in (False, True):
            sol = solve_chain(tab, prof, src, snk, objective=obj, min_partitions=kmin,
                              max_partitions=kmax, free=farr, prune=prune)
            bf = brute_force(devs, prof, ids[src], ids[snk], obj, kmax, free, kmin)
            if bf is None:
                assert sol is None
                continue
            assert sol is not None and sol.exact
            assert kmin <= len(sol.parts) <= min(n, kmax or n)
            assert len({z for _, _, z in sol.parts}) == len(sol.parts)
            assert _value(devs, prof, sol, src, snk, obj) == pytest.approx(
                bf[0], rel=1e-9, abs=1e-15)


def test_min_partitions_forces_a_split_of_a_model_that_fits_one_device() -> None:
    devs = [dev("a", memory_bytes=1e9, flops=1e10), dev("b", memory_bytes=1e9),
            dev("c", memory_bytes=1e9)]
    tab = DeviceTable.from_devices(devs)
    one = solve_chain(tab, profile(4), 0, 0)
    assert one is not None and len(one.parts) == 1
    three = solve_chain(tab, profile(4), 0, 0, min_partitions=3, max_partitions=3)
    assert three is not None and len(three.parts) == 3
    assert solve_chain(tab, profile(4), 0, 0, min_partitions=4) is None  # only 3 devices


def test_demo_residual_cnn_three_partitions_two_replicas() -> None:
    devs = [dev("cam", memory_bytes=0.0, labels=(("power-domain", "cam"),))] + [
        dev(f"n{i}", memory_bytes=1e6, flops=1e9 * (1 + i), labels=(("power-domain", f"p{i % 6}"),))
        for i in range(8)]  # 3 partitions x 2 replicas need 6 power domains (replica rule)
    fl = Fleet(tuple(devs))
    w = Workload("resnet", "cam", "cam", replicas=2, min_partitions=3, max_partitions=3,
                 profile=profile(6))
    plan = schedule(fl, [w])
    assert validate_plan(plan, fl, [w]) == []
    r = plan.result("resnet")
    assert r.placed and [len(rep.partitions) for rep in r.replicas] == [3, 3]
    # Kept on the next reconcile; a running placement with too few partitions is re-placed.
    again = schedule(fl, [w], current=plan.placements)
    assert again.result("resnet").kept
    loose = Workload("resnet", "cam", "cam", replicas=2, profile=profile(6))
    single = schedule(fl, [loose])
    assert [len(rep.partitions) for rep in single.result("resnet").replicas] == [1, 1]
    moved = schedule(fl, [w], current=single.placements)
    assert not moved.result("resnet").kept
    assert [len(rep.partitions) for rep in moved.result("resnet").replicas] == [3, 3]
    assert validate_plan(moved, fl, [w]) == []


def test_min_partitions_unsatisfiable_is_pending_with_reason() -> None:
    fl = Fleet((dev("cam", memory_bytes=0.0), dev("a", memory_bytes=1e9)))
    w = Workload("w", "cam", "cam", min_partitions=3, profile=profile(4))
    r = schedule(fl, [w]).result("w")
    assert r.status == "pending" and "min_partitions 3" in r.reason_map["fit"]


def test_validator_flags_too_few_partitions() -> None:
    fl = Fleet((dev("cam", memory_bytes=0.0), dev("a", memory_bytes=1e9)))
    loose = Workload("w", "cam", "cam", profile=profile(4))
    plan = schedule(fl, [loose])
    strict = Workload("w", "cam", "cam", min_partitions=2, profile=profile(4))
    assert any("min_partitions" in e for e in validate_plan(plan, fl, [strict]))


@pytest.mark.parametrize("extra,needle", [
    ({"min_partitions": 0}, "min_partitions"),
    ({"min_partitions": "3"}, "min_partitions"),
    ({"min_partitions": 2.5}, "min_partitions"),
    ({"min_partitions": True}, "min_partitions"),
    ({"min_partitions": 3, "max_partitions": 2}, "min_partitions"),
    ({"min_partitions": 5}, "min_partitions 5 > the 4 segments"),
])
def test_min_partitions_validated(extra: dict[str, object], needle: str) -> None:
    doc = {"name": "w", "source": "a", "sink": "a", "profile": profile(4).to_dict(), **extra}
    with pytest.raises(SpecError, match=needle):
        Workload.from_dict(doc)


def test_min_partitions_round_trip_and_default() -> None:
    doc = {"name": "w", "source": "a", "sink": "a", "profile": profile(4).to_dict(),
           "min_partitions": 3, "max_partitions": 3}
    w = Workload.from_dict(doc)
    assert w.min_partitions == 3 and w.to_dict()["min_partitions"] == 3
    assert Workload.from_dict(w.to_dict()) == w
    plain = Workload.from_dict({**doc, "min_partitions": 1})
    assert plain.min_partitions == 1 and "min_partitions" not in plain.to_dict()
    # Checked against the profile also when the model is resolved later (dataclass replace).
    from dataclasses import replace

    lazy = Workload("w", "a", "a", model="m.onnx", min_partitions=5)
    with pytest.raises(SpecError, match="min_partitions"):
        replace(lazy, profile=profile(4))


def test_static_filters_cached_on_the_snapshot() -> None:
    fl = Fleet((dev("cam", memory_bytes=0.0), dev("a", memory_bytes=1e9)))
    w = Workload("w", "cam", "cam", profile=profile(2))
    p1 = schedule(fl, [w])
    keys = [k for k in fl.cache if isinstance(k, tuple) and k[0] == "mask"]
    assert keys and len(keys) == len({k[1] for k in keys})  # one verdict per filter and spec
    p2 = schedule(fl, [w])
    assert [k for k in fl.cache if isinstance(k, tuple) and k[0] == "mask"] == keys
    assert p1.result("w").replicas == p2.result("w").replicas


@pytest.mark.parametrize("seed", range(6))
def test_chain_length_bound_is_safe(seed: int) -> None:
    """Every chain longer than the bound costs more than the best one-device chain."""
    from fog_broker.placement.chain import chain_length_bound

    rng = random.Random(700 + seed)
    checked = 0
    for _ in range(20):
        devs, prof = random_instance(rng, rng.randint(2, 5), rng.randint(2, 4),
                                     tight=rng.random() < 0.3)
        n = len(prof.segments)
        src, snk = rng.randrange(len(devs)), rng.randrange(len(devs))
        obj = rng.choice(["latency", "energy"])
        tab = DeviceTable.from_devices(devs)
        ok = tab.memory >= min(s.param_bytes + s.activation_bytes for s in prof.segments)
        k, single = chain_length_bound(tab, prof, src, snk, obj, n, tab.memory, ok)
        ids = [d.id for d in devs]
        one = brute_force(devs, prof, ids[src], ids[snk], obj, 1)
        assert (single is None) == (one is None)
        if single is None or one is None:
            continue
        assert single[0] == pytest.approx(one[0], rel=1e-9)
        for longer in range(k + 1, n + 1):
            bf = brute_force(devs, prof, ids[src], ids[snk], obj, longer, min_partitions=longer)
            assert bf is None or bf[0] > single[0]
            checked += 1
    assert checked > 0
