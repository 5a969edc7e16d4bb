"""The throughput objective: the exact chain optimiser minimises the bottleneck stage."""
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
)
from fog_broker.placement.cost import stage_times

from placement_helpers import brute_force, dev, profile, random_instance


def _check(devs, prof, src, snk, K, free=None, bound=None, kmin=1):  # type: ignore[no-untyped-def]
    tab = DeviceTable.from_devices(devs)
    ids = [d.id for d in devs]
    farr = None if free is None else np.array([free[i] for i in ids])
    sol = solve_chain(tab, prof, src, snk, objective="throughput", max_partitions=K, free=farr,
                      max_latency_s=bound, min_partitions=kmin)
    bf = brute_force(devs, prof, ids[src], ids[snk], "throughput", K, free, kmin, bound)
    if bf is None:
        assert sol is None
        return None
    assert sol is not None and sol.exact
    pl = [PartitionPlacement(f, last, ids[z]) for f, last, z in sol.parts]
    used = [p.device for p in pl]
    assert len(set(used)) == len(used), "chain revisits a device"
    mem = free or {d.id: d.memory_bytes for d in devs}
    assert all(prof.memory_of(p.first, p.last) <= mem[p.device] for p in pl)
    assert kmin <= len(pl) <= (K or len(prof.segments))
    cc = chain_cost(prof, pl, {d.id: d for d in devs}, ids[src], ids[snk])
    assert cc.bottleneck_s == pytest.approx(bf[0], rel=1e-9, abs=1e-15)
    assert sol.value == pytest.approx(cc.bottleneck_s, rel=1e-9, abs=1e-15)
    if bound is not None:
        assert cc.latency_s <= bound * (1 + 1e-9)
    return sol


@pytest.mark.parametrize("seed", range(10))
def test_exact_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        devs, prof = random_instance(rng, rng.randint(2, 5), rng.randint(1, 5))
        _check(devs, prof, rng.randrange(len(devs)), rng.randrange(len(devs)),
               rng.choice([None, None, 1, 2, 3]))


@pytest.mark.parametrize("seed", range(10))
def test_exact_with_latency_bound(seed: int) -> None:
    """A bound between the fastest chain and the best-throughput chain's latency binds."""
    rng = random.Random(100 + seed)
    for _ in range(20):
        devs, prof = random_instance(rng, rng.randint(2, 5), rng.randint(1, 5), tight=False)
        src, snk = rng.randrange(len(devs)), rng.randrange(len(devs))
        ids = [d.id for d in devs]
        fast = brute_force(devs, prof, ids[src], ids[snk], "latency", None)
        thr = brute_force(devs, prof, ids[src], ids[snk], "throughput", None)
        assert fast is not None and thr is not None
        lat_thr = chain_cost(prof, thr[1], {d.id: d for d in devs}, ids[src],
                             ids[snk]).latency_s
        bound = fast[0] + rng.random() * max(0.0, lat_thr - fast[0])
        _check(devs, prof, src, snk, None, bound=bound * (1 + 1e-7))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_dev=st.integers(2, 5), n_seg=st.integers(1, 5),
       k=st.sampled_from([None, 1, 2, 4]), kmin=st.sampled_from([1, 1, 2]),
       tight=st.booleans(), bounded=st.booleans())
def test_exact_property(seed: int, n_dev: int, n_seg: int, k: int | None, kmin: int,
                        tight: bool, bounded: bool) -> None:
    rng = random.Random(seed)
    devs, prof = random_instance(rng, n_dev, n_seg, tight=tight)
    if (k is not None and kmin > k) or kmin > n_seg:
        kmin = 1
    free = {d.id: d.memory_bytes * rng.uniform(0.2, 1.0) for d in devs}
    bound = rng.uniform(0.01, 2.0) if bounded else None
    _check(devs, prof, rng.randrange(n_dev), rng.randrange(n_dev), k, free, bound, kmin)


def test_pruned_solve_agrees_with_unpruned() -> None:
    rng = random.Random(7)
    for _ in range(30):
        devs, prof = random_instance(rng, 7, 5, tight=False)
        tab = DeviceTable.from_devices(devs)
        a = solve_chain(tab, prof, 0, 1, objective="throughput", prune=False)
        b = solve_chain(tab, prof, 0, 1, objective="throughput", prune=True)
        assert a is not None and b is not None
        assert a.value == pytest.approx(b.value, rel=1e-12)


def test_two_equal_devices_split_the_work_for_throughput() -> None:
    """Latency keeps the model whole on one device; throughput splits it in two halves."""
    devs = [dev("cam", flops=1e6, memory_bytes=0), dev("a", memory_bytes=1e9,
            uplink_bps=1e9, downlink_bps=1e9, rtt_s=0.0), dev("b", memory_bytes=1e9,
            uplink_bps=1e9, downlink_bps=1e9, rtt_s=0.0)]
    prof = profile(4, flops=1e8, out=1e3)
    tab = DeviceTable.from_devices(devs)
    lat = solve_chain(tab, prof, 0, 0, objective="latency")
    thr = solve_chain(tab, prof, 0, 0, objective="throughput")
    assert lat is not None and len(lat.parts) == 1
    assert thr is not None and [(f, last) for f, last, _ in thr.parts] == [(0, 1), (2, 3)]
    assert thr.value == pytest.approx(0.2)  # two segments of 0.1 s each per stage


def test_measured_segment_times_drive_the_split() -> None:
    devs = [dev("cam", flops=1e6, memory_bytes=0), dev("a", memory_bytes=1e9,
            uplink_bps=1e9, downlink_bps=1e9), dev("b", memory_bytes=1e9,
            uplink_bps=1e9, downlink_bps=1e9)]
    prof = profile(4, flops=1e8, out=1e3).with_times({"a": (0.3, 0.01, 0.01, 0.01),
                                                      "b": (0.3, 0.01, 0.01, 0.01)})
    sol = solve_chain(DeviceTable.from_devices(devs), prof, 0, 0, objective="throughput")
    assert sol is not None and [(f, last) for f, last, _ in sol.parts] == [(0, 0), (1, 3)]
    assert sol.value == pytest.approx(0.3)


def test_stage_times_name_links_and_compute() -> None:
    devs = {d.id: d for d in [dev("cam"), dev("a"), dev("b")]}
    prof = profile(2, out=1e4, inp=1e3)
    st_ = stage_times(prof, [PartitionPlacement(0, 0, "a"), PartitionPlacement(1, 1, "b")],
                      devs, "cam", "cam")
    assert [n for n, _ in st_] == ["link cam->a", "compute a", "link a->b", "compute b",
                                   "link b->cam"]
    assert st_[2][1] == pytest.approx(8e4 / 1e7)


def _fleet_and_workload(bound: float | None) -> tuple[Fleet, Workload]:
    devs = (dev("cam", flops=1e6, memory_bytes=0, uplink_bps=1e9, downlink_bps=1e9),
            dev("a", memory_bytes=1e9, uplink_bps=1e9, downlink_bps=1e9),
            dev("b", memory_bytes=1e9, uplink_bps=1e9, downlink_bps=1e9))
    w = Workload("w", "cam", "cam", objective="throughput", profile=profile(4, flops=1e8),
                 max_latency_s=bound)
    return Fleet(devs), w


def test_scheduler_places_throughput_workload_and_reports_bottleneck() -> None:
    fleet, w = _fleet_and_workload(None)
    res = schedule(fleet, [w]).result("w")
    assert res.placed and len(res.replicas[0].partitions) == 2
    assert res.replicas[0].bottleneck_s == pytest.approx(0.2, rel=1e-3)


def test_unmeetable_latency_bound_is_pending_with_reason() -> None:
    fleet, w = _fleet_and_workload(0.1)  # the whole model takes 0.4 s anywhere
    res = schedule(fleet, [w]).result("w")
    assert not res.placed
    assert "latency" in res.reason_map
    assert "0.1" in res.reason_map["latency"]


def test_bad_objective_and_bound_are_spec_errors() -> None:
    with pytest.raises(SpecError, match="objective"):
        Workload("w", "a", "a", objective="fps", profile=profile(1))
    with pytest.raises(SpecError, match="max_latency_s"):
        Workload("w", "a", "a", objective="throughput", profile=profile(1), max_latency_s=0.0)
    with pytest.raises(SpecError, match="max_latency_s"):
        Workload("w", "a", "a", objective="energy", profile=profile(1), max_latency_s=1.0)
    w = Workload.from_dict({"name": "w", "source": "a", "sink": "a", "objective": "throughput",
                            "max_latency_s": 0.5, "profile": profile(1).to_dict()})
    assert w.max_latency_s == 0.5 and w.to_dict()["max_latency_s"] == 0.5


def test_failover_without_a_wall_clock_keeps_a_live_deadline() -> None:
    """A device loss heard in an advert reaches the site core without the wall clock: the
    retried attempt's deadline must still be in wall-clock time (``SiteCore`` owns the clock;
    the router takes the wall it is given), not seconds since the fog started."""
    from collections.abc import Sequence

    from fog_broker import placement
    from fog_broker.controller import DeployPartition
    from fog_broker.router import SendActivation
    from fog_broker.site_core import Ack, Advert, Infer, SetWorkload, SiteCore, SiteCoreConfig
    from runtime.messages import (
        DeviceBirth,
        DeviceDeath,
        DeviceState,
        InferenceRequest,
        PartitionStatus,
    )

    mem = {"src": 1, "a": 100_000_000, "b": 100_000_000}
    wall0 = 1_700_000_000.0  # the wall clock at monotonic 0
    core = SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0))
    running: dict[str, dict[tuple[str, int, int, int], PartitionStatus]] = {d: {} for d in mem}
    seq = dict.fromkeys(mem, 1)
    now = 0.0

    def carry(cmds: Sequence[object]) -> list[object]:
        """The devices deploy and ack at once; what else the core says is returned."""
        rest: list[object] = []
        queue = list(cmds)
        while queue:
            c = queue.pop(0)
            if isinstance(c, DeployPartition):
                key = (c.workload, c.version, c.replica, c.index)
                running[c.device][key] = PartitionStatus(*key, sha256="0" * 64, health="running")
                queue += core.handle(Ack(c.device, c.command_id, True, ""), now)
            else:
                rest.append(c)
        return rest

    for d, m in mem.items():
        carry(core.handle(Advert(DeviceBirth(
            device_id=d, epoch=1, seq=1, site="s", public_key=bytes(32), flops=1e10,
            memory_bytes=m, uplink_bps=1e8, downlink_bps=1e8, rtt_s=1e-3, power_active_w=5.0,
            power_idle_w=1.0, tx_j_per_byte=1e-8, rx_j_per_byte=1e-8, state_interval_s=1.0)),
            now))
    prof = placement.ChainProfile("m", 1000.0, (placement.Segment("s0", 1e9, 1e6, 1e6, 1000.0),))
    carry(core.handle(SetWorkload(Workload("w", "src", "src", replicas=2, profile=prof), 1), now))
    while now < 30.0 and len(core.controller.chains("w")) < 2:
        now += 0.5
        carry(core.tick(now, wall0 + now))
        for d in mem:
            seq[d] += 1
            carry(core.handle(Advert(DeviceState(
                device_id=d, epoch=1, seq=seq[d], free_memory_bytes=mem[d],
                partitions=tuple(running[d].values()))), now))
    assert len(core.controller.chains("w")) == 2
    req = InferenceRequest("q1", "w", "reply/c", {"x": np.zeros(1, np.float32)}, 10.0)
    first = carry(core.handle(Infer(req, wall0 + now), now))
    assert isinstance(first[0], SendActivation)
    assert first[0].activation.deadline == pytest.approx(wall0 + now + 10.0)
    lost = first[0].device
    now += 1.0
    out = [c for c in carry(core.handle(Advert(DeviceDeath(device_id=lost, epoch=1)), now))
           if isinstance(c, SendActivation)]
    assert out and out[0].device != lost
    assert out[0].activation.deadline == pytest.approx(wall0 + now + 9.0)
