"""Scenarios of the multi-workload scheduler: filters, gang, quota, preemption, reasons, metrics."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fog_broker.placement import (
    Fleet,
    Quota,
    SchedulerConfig,
    Taint,
    Toleration,
    Workload,
    schedule,
    validate_plan,
)

from placement_helpers import dev, profile, random_instance


def wl(name: str, n: int = 4, **kw: object) -> Workload:
    base: dict[str, object] = dict(source="src", sink="src", profile=profile(n))
    base.update(kw)
    return Workload(name=name, **base)  # type: ignore[arg-type]


SRC = dev("src", memory_bytes=0.0)


def fleet(*devs: object) -> Fleet:
    return Fleet((SRC, *devs))  # type: ignore[arg-type]


def check(plan, fl, wls, quotas=None):  # type: ignore[no-untyped-def]
    assert validate_plan(plan, fl, wls, quotas) == []
    return plan


@pytest.mark.parametrize("name,device,w,gate,phrase", [
    ("dead", dev("a", alive=False), wl("w"), "alive", "device not alive"),
    ("selector", dev("a", labels=(("zone", "x"),)), wl("w", selectors=(("zone", "y"),)),
     "selector", "selector mismatch"),
    ("taint", dev("a", taints=(Taint("gpu", "t", "NoSchedule"),)), wl("w"), "taint",
     "untolerated taint"),
    ("battery", dev("a", battery_capacity_wh=10.0, battery_level=0.05), wl("w"), "energy", "battery below floor"),
    ("memory", dev("a", memory_bytes=1e3), wl("w"), "fit", "insufficient memory"),
])
def test_single_filter_reasons(name: str, device, w: Workload, gate: str, phrase: str) -> None:  # type: ignore[no-untyped-def]
    fl = fleet(device)
    plan = check(schedule(fl, [w]), fl, [w])
    r = plan.result("w")
    assert r.status == "pending"
    assert gate in r.reason_map
    hist = r.detail_map["histogram"]
    assert hist[phrase] >= 1
    assert "0/2 devices fit" in r.reason_map["fit"]


def test_toleration_and_charging_battery_allow_placement() -> None:
    fl = fleet(dev("a", taints=(Taint("gpu", "t", "NoSchedule"),), battery_capacity_wh=10.0, battery_level=0.05,
                   charging=True))
    w = wl("w", tolerations=(Toleration("gpu"),))
    plan = check(schedule(fl, [w]), fl, [w])
    assert plan.result("w").placed


def test_histogram_counts_fixed_phrases() -> None:
    zy = (("zone", "y"),)
    fl = fleet(dev("a", memory_bytes=1e3, labels=zy), dev("b", memory_bytes=1e3, labels=zy),
               dev("c", labels=(("zone", "x"),)), dev("d", alive=False))
    w = wl("w", selectors=zy)
    r = schedule(fl, [w]).result("w")
    assert r.reason_map["fit"].startswith(
        "0/5 devices fit: 2 insufficient memory, 2 selector mismatch, 1 device not alive")
    assert r.detail_map["histogram"] == {"insufficient memory": 2, "selector mismatch": 2,
                                         "device not alive": 1}
    assert r.reason_map["selector"] == "2 devices do not match selector zone=y"


def test_fragmented_vs_short() -> None:
    # 4 segments of 150 kB each (100 kB params + 50 kB act): needs 450 kB as one partition.
    small = [dev(f"m{i}", memory_bytes=1.2e5) for i in range(5)]  # fit nothing: 150 kB > 120 kB
    fl = fleet(*small)
    r = schedule(fl, [wl("w")]).result("w")
    assert "0/6 devices fit" in r.reason_map["fit"]
    frag = [dev(f"f{i}", memory_bytes=1.6e5) for i in range(3)]  # 3 x 160 kB: chain of 4 needs 4
    fl2 = fleet(*frag)
    r2 = schedule(fl2, [wl("w")]).result("w")
    assert "fragmented" in r2.reason_map["fit"] and r2.detail_map["fragmented"] is True
    fl3 = fleet(dev("tiny", memory_bytes=1.6e5))
    r3 = schedule(fl3, [wl("w")]).result("w")
    assert "only" in r3.reason_map["fit"] and r3.detail_map["fragmented"] is False


def test_gang_all_replicas_or_nothing_and_no_leftover() -> None:
    a = dev("a", labels=(("power-domain", "p1"),))
    b = dev("b", labels=(("power-domain", "p1"),))
    fl = fleet(a, b)
    w = wl("w", replicas=2)
    plan = check(schedule(fl, [w]), fl, [w])
    r = plan.result("w")
    assert r.status == "pending" and "anti-affinity" in r.reason_map
    assert plan.metrics.utilization == 0.0  # the primary's reservation was released


def test_replicas_spread_over_power_domains() -> None:
    devs = [dev(f"d{i}", labels=(("power-domain", f"p{i % 2}"),)) for i in range(4)]
    fl = fleet(*devs)
    w = wl("w", replicas=2)
    plan = check(schedule(fl, [w]), fl, [w])
    r = plan.result("w")
    assert r.placed and len(r.replicas) == 2
    doms = [{dict(fl.get(p.device).labels)["power-domain"] for p in rep.partitions}  # type: ignore[union-attr]
            for rep in r.replicas]
    assert not (doms[0] & doms[1])


def test_quota_reason_and_other_tenant_unaffected() -> None:
    fl = fleet(dev("a", memory_bytes=1e7))
    ws = [wl("w1", tenant="t1"), wl("w2", tenant="t2")]
    q = {"t1": Quota(1e5)}
    plan = check(schedule(fl, ws, quotas=q), fl, ws, q)
    r = plan.result("w1")
    assert r.status == "pending" and r.reason_map["quota"].startswith("quota exhausted: tenant t1")
    assert "fit" not in r.reason_map  # it would fit the devices: only the quota gate failed
    assert plan.result("w2").placed


def test_priority_order_and_preemption_lists_evicted() -> None:
    fl = fleet(dev("a", memory_bytes=6.5e5))  # one 4-segment model (450 kB) at a time
    low = wl("low", priority=0)
    high = wl("high", priority=10)
    first = check(schedule(fl, [low]), fl, [low])
    assert first.result("low").placed
    plan = check(schedule(fl, [low, high], current=first.placements), fl, [low, high])
    assert plan.result("high").placed
    assert plan.evicted == ("low",)
    r = plan.result("low")
    assert r.status == "pending" and "preempted" in r.reason_map
    assert r.detail_map["evicted_by"] == "high"


def test_preemption_evicts_fewest_lowest_priority() -> None:
    fl = fleet(dev("a", memory_bytes=1.0e6), dev("b", memory_bytes=1.0e6))
    ws = [wl("l1", n=3, priority=1), wl("l2", n=3, priority=2),
          wl("l0", n=6, priority=0)]
    base = check(schedule(fl, ws), fl, ws)
    assert all(r.placed for r in base.workloads)
    big = wl("big", n=6, priority=5)
    plan = check(schedule(fl, ws + [big], current=base.placements), fl, ws + [big])
    assert plan.result("big").placed
    assert plan.evicted == ("l0",)


def test_no_preemption_of_equal_priority() -> None:
    fl = fleet(dev("a", memory_bytes=6.5e5))
    a, b = wl("a"), wl("b")
    first = schedule(fl, [a])
    plan = schedule(fl, [a, b], current=first.placements)
    assert plan.result("a").placed and plan.result("b").status == "pending"
    assert plan.evicted == ()


def test_current_kept_stable_and_replaced_when_device_dies() -> None:
    fast = dev("fast", flops=1e11)
    slow = dev("slow", flops=1e9)
    fl = fleet(slow)
    w = wl("w")
    first = schedule(fl, [w])
    assert first.result("w").replicas[0].devices == ("slow",)
    fl2 = fleet(slow, fast)
    again = schedule(fl2, [w], current=first.placements)
    assert again.result("w").replicas[0].devices == ("slow",) and again.result("w").kept
    fl3 = fleet(replace(slow, alive=False), fast)
    moved = check(schedule(fl3, [w], current=first.placements), fl3, [w])
    assert moved.result("w").replicas[0].devices == ("fast",) and not moved.result("w").kept


def test_metrics_exact() -> None:
    fl = fleet(dev("a", memory_bytes=1e6), dev("b", memory_bytes=1e6), dev("c", alive=False))
    w = wl("w")  # 4 x (100 kB params), peak act 50 kB -> 450 kB on one device
    plan = schedule(fl, [w])
    assert plan.result("w").replicas[0].partitions[0].device in ("a", "b")
    assert plan.metrics.utilization == pytest.approx(4.5e5 / 2e6)  # src has 0 bytes
    assert plan.metrics.fragmentation == pytest.approx(1 - 4.5e5 / 1e6)


def test_missing_profile_and_unknown_source_are_reasons() -> None:
    fl = fleet(dev("a"))
    ws = [Workload("m", "src", "src", model="x.onnx"), wl("s", source="nowhere")]
    plan = schedule(fl, ws)
    assert "model" in plan.result("m").reason_map
    assert "source" in plan.result("s").reason_map


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_valid(seed: int) -> None:
    rng = random.Random(seed)
    devs, _ = random_instance(rng, 12, 1)
    fl = Fleet(tuple(devs))
    ws = []
    for i in range(6):
        _, prof = random_instance(rng, 1, rng.randint(2, 6))
        ws.append(Workload(f"w{i}", "d0", f"d{rng.randrange(12)}", tenant=f"t{i % 2}",
                           priority=rng.randint(0, 2), replicas=rng.choice([1, 1, 2]),
                           objective=rng.choice(["latency", "energy"]), profile=prof))
    q = {"t0": Quota(3e6)}
    plan = schedule(fl, ws, quotas=q)
    assert validate_plan(plan, fl, ws, q) == []
    plan2 = schedule(fl, ws, current=plan.placements, quotas=q)
    assert validate_plan(plan2, fl, ws, q) == []
    for r in plan.workloads:  # stable: nothing placed moves on an unchanged snapshot
        if r.placed and plan2.result(r.name).placed:
            assert plan2.result(r.name).replicas == r.replicas


def test_config_disables_preemption() -> None:
    fl = fleet(dev("a", memory_bytes=6.5e5))
    low, high = wl("low"), wl("high", priority=9)
    first = schedule(fl, [low])
    plan = schedule(fl, [low, high], current=first.placements,
                    config=SchedulerConfig(preemption=False))
    assert plan.result("high").status == "pending" and plan.evicted == ()


def test_validator_catches_violations() -> None:
    from fog_broker.placement import (
        PartitionPlacement,
        Plan,
        PlanMetrics,
        ReplicaPlacement,
        WorkloadResult,
    )

    fl = fleet(dev("a", memory_bytes=1e5), dev("b", alive=False))
    w = wl("w")
    bad = Plan((WorkloadResult("w", "placed", (ReplicaPlacement(
        (PartitionPlacement(0, 1, "a"), PartitionPlacement(2, 3, "b")), 1.0, 1.0),)),),
        (), PlanMetrics(0.0, 0.0))
    errs = " | ".join(validate_plan(bad, fl, [w]))
    for needle in ("not alive", "available", "reported latency_s", "reported energy_j"):
        assert needle in errs, errs
    gap = Plan((WorkloadResult("w", "placed", (ReplicaPlacement(
        (PartitionPlacement(0, 1, "a"), PartitionPlacement(3, 3, "a")), 1.0, 1.0),)),),
        (), PlanMetrics(0.0, 0.0))
    assert any("tile" in e for e in validate_plan(gap, fl, [w]))
