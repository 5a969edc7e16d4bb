"""The scheduler's fast path (each filter's numpy ``batch``, the chain solver as the score's batch)
agrees with the slow path (``filter`` per device, the reference cost model per chain) on random
fleets, hostile-but-valid values at the edges of the documented ranges included: the same
feasible set, the same first failing phrase per device, the same pending sentences, the same
scores; and the snapshot's cached verdicts never leak from one workload spec to another.

The fleets mix random devices with every filter's declared ``examples`` (devices it passes and
fails), and each filter's ``filter`` and ``batch`` must give its examples' declared verdicts: a
new filter in ``filters`` is covered by declaring its examples, with no edit here."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fog_broker.placement import (
    ChainProfile,
    Device,
    DeviceTable,
    Fleet,
    PartitionPlacement,
    ReplicaPlacement,
    Segment,
    Taint,
    Toleration,
    Workload,
    chain_cost,
    explain,
    schedule,
)
from fog_broker.placement.plugins import (
    EXAMPLE_CONTEXT,
    EXAMPLE_DEVICE,
    EXAMPLE_WORKLOAD,
    SCORE,
    Context,
    NodeView,
    filters,
    first_failure,
    first_failures,
    pending_reasons,
)
from runtime.devices import RESOURCE_RANGES

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
LABELS = (("zone", "x"), ("zone", "y"), ("power-domain", "p0"), ("power-domain", "p1"))
TAINTS = (Taint("gpu", "t", "NoSchedule"), Taint("gpu", "u", "NoExecute"),
          Taint("edge", "", "PreferNoSchedule"), Taint("edge", "", "NoSchedule"))


def edges(name: str, typical: float) -> st.SearchStrategy[float]:
    """The edges of a field's documented range, its plausible cap, a typical value, and between."""
    r = RESOURCE_RANGES[name]
    lo = math.nextafter(r.lo, math.inf) if r.lo_open else r.lo
    marks = [lo, float(r.hi), typical] + ([r.plausible] if r.plausible is not None else [])
    return st.one_of(st.sampled_from(marks), st.floats(lo, r.hi, allow_nan=False,
                                                       allow_infinity=False))


MOSTLY = st.sampled_from([True, True, True, False])
batteries = st.one_of(st.just({}), st.fixed_dictionaries({
    "battery_capacity_wh": st.sampled_from([1e-9, 10.0, 1e6]),
    "battery_level": st.one_of(st.sampled_from([0.0, 0.2, 1.0]), st.floats(0.0, 1.0)),
    "charging": st.booleans()}))


@st.composite
def devices(draw: st.DrawFn, i: int) -> Device:
    return Device(
        id=f"d{i}", flops=draw(edges("flops", 1e10)),
        memory_bytes=draw(edges("memory_bytes", 1e6)),
        uplink_bps=draw(edges("uplink_bps", 1e8)), downlink_bps=draw(edges("downlink_bps", 1e8)),
        rtt_s=draw(edges("rtt_s", 1e-3)), power_active_w=draw(edges("power_active_w", 5.0)),
        power_idle_w=0.0,
        tx_j_per_byte=draw(edges("tx_j_per_byte", 1e-7)),
        rx_j_per_byte=draw(edges("rx_j_per_byte", 1e-7)),
        labels=tuple(draw(st.lists(st.sampled_from(LABELS), unique=True, max_size=2))),
        taints=tuple(draw(st.lists(st.sampled_from(TAINTS), unique=True, max_size=2))),
        **draw(batteries), alive=draw(MOSTLY), providers=tuple(draw(st.lists(
            st.sampled_from([CPU, CUDA]), unique=True))),
        verified=draw(MOSTLY), throttled=not draw(MOSTLY), measured=draw(MOSTLY))


# Every registered filter's declared examples (the same classes for every context).
EXAMPLES = tuple(change for f in filters(Context()) for change in (*f.examples.passes,
                                                                   *f.examples.fails))


def example_devices(i: int) -> st.SearchStrategy[Device]:
    return st.sampled_from(EXAMPLES).map(lambda change: replace(EXAMPLE_DEVICE, id=f"d{i}",
                                                                **change))


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    n = draw(st.integers(2, 7))
    return Fleet(tuple(draw(st.one_of(devices(i), example_devices(i))) for i in range(n)))


def test_each_filter_gives_its_examples_their_verdicts() -> None:
    for f in filters(EXAMPLE_CONTEXT):
        passes, fails = f.examples.passes, f.examples.fails
        assert passes and fails, f"{f.name} declares no example it passes, or none it fails"
        fleet = Fleet(tuple(replace(EXAMPLE_DEVICE, id=f"e{i}", **change)
                            for i, change in enumerate((*passes, *fails))))
        free = np.array([d.memory_bytes for d in fleet.devices])
        want = [True] * len(passes) + [False] * len(fails)
        slow = [f.filter(EXAMPLE_WORKLOAD, NodeView(d, float(b))).ok
                for d, b in zip(fleet.devices, free)]
        assert slow == want, f"{f.name}.filter on its examples"
        assert list(f.batch(EXAMPLE_WORKLOAD, fleet, free)) == want, f"{f.name}.batch on its examples"


@st.composite
def workloads(draw: st.DrawFn, fleet: Fleet, name: str = "w") -> Workload:
    n = draw(st.integers(1, 4))
    prof = ChainProfile("m", draw(st.sampled_from([1.0, 3072.0, 1e7])), tuple(
        Segment(f"s{i}", draw(st.sampled_from([1.0, 1e8, 1e12])),
                draw(st.sampled_from([0.0, 1e5, 1e9])), draw(st.sampled_from([0.0, 5e4])),
                draw(st.sampled_from([1.0, 1e4, 1e8]))) for i in range(n)))
    ids = [d.id for d in fleet.devices]
    lo = draw(st.integers(1, n))
    return Workload(
        name, draw(st.sampled_from(ids)), draw(st.sampled_from(ids)),
        replicas=draw(st.integers(1, 3)),
        objective=draw(st.sampled_from(["latency", "energy", "throughput"])),
        selectors=tuple(draw(st.lists(st.sampled_from(LABELS[:2]), unique=True, max_size=1))),
        tolerations=tuple(draw(st.lists(st.sampled_from(
            [Toleration("gpu"), Toleration("gpu", "u"), Toleration("edge", "", "NoSchedule")]),
            unique=True, max_size=2))),
        providers=tuple(draw(st.lists(st.sampled_from([CPU, CUDA]), unique=True, max_size=1))),
        min_partitions=lo, max_partitions=draw(st.one_of(st.none(), st.integers(lo, n))),
        profile=prof)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Fleet, Workload, Context, np.ndarray]:
    fleet = draw(fleets())
    w = draw(workloads(fleet))
    if draw(st.booleans()):  # half the cases: a plain workload, which most devices pass
        w = replace(w, selectors=(), providers=())
    assert w.profile is not None
    mem = np.array([d.memory_bytes for d in fleet.devices])
    free = mem * np.array([draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in fleet.devices])
    domains = sorted({d.power_domain for d in fleet.devices})
    ctx = Context(draw(st.sampled_from([0.0, 0.2, 1.0])), draw(st.integers(0, 2)),
                  frozenset(draw(st.lists(st.sampled_from(domains), unique=True))),
                  min(s.param_bytes + s.activation_bytes for s in w.profile.segments),
                  draw(st.booleans()))
    return fleet, w, ctx, free


def slow_first(fleet: Fleet, w: Workload, ctx: Context, free: np.ndarray) -> list[int]:
    fs = filters(ctx)
    names = [f.name for f in fs]
    out = []
    for d, f in zip(fleet.devices, free):
        status = first_failure(fs, w, NodeView(d, float(f)))
        assert status.ok or status.reasons == (fs[names.index(status.plugin)].phrase,)
        out.append(-1 if status.ok else names.index(status.plugin))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_filters_fast_and_slow_paths_agree(case: tuple[Fleet, Workload, Context, np.ndarray]
                                           ) -> None:
    fleet, w, ctx, free = case
    fs = filters(ctx)
    masks = [f.batch(w, fleet, free) for f in fs]
    for f, m in zip(fs, masks):
        verdicts = [f.filter(w, NodeView(d, float(b))).ok for d, b in zip(fleet.devices, free)]
        assert m.dtype == bool and list(m) == verdicts, f.name
    fast = first_failures(masks)
    slow = slow_first(fleet, w, ctx, free)
    assert list(fast) == slow  # the same feasible set, and the same phrase per device
    reasons, tally = pending_reasons(fs, w, fast, free, ctx.replica)
    assert pending_reasons(fs, w, np.array(slow, dtype=np.int64), free, ctx.replica)[0] == reasons
    assert tally.hist == explain.histogram(fs[i].phrase for i in slow if i >= 0)
    assert [g for g, _ in reasons][-1] == "fit" and len({g for g, _ in reasons}) == len(reasons)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_score_batch_is_the_reference_cost_of_its_chain(
        case: tuple[Fleet, Workload, Context, np.ndarray]) -> None:
    fleet, w, ctx, _ = case
    assert w.profile is not None
    table = DeviceTable.from_devices(fleet.devices)
    free = table.memory  # a fresh plan, no other replica: more of the cases find a chain
    fs = filters(Context(ctx.battery_floor, min_bytes=ctx.min_bytes))
    eligible = np.logical_and.reduce([f.batch(w, fleet, free) for f in fs])
    src, snk = fleet.index[w.source], fleet.index[w.sink]
    sol = SCORE.batch(w, table, src, snk, free=free, eligible=eligible, node_limit=200)
    event("placed" if sol is not None else "no chain")
    if sol is None:
        return
    parts = tuple(PartitionPlacement(f, last, table.ids[z]) for f, last, z in sol.parts)
    for _, _, z in sol.parts:  # every partition on a device that passes every filter
        assert eligible[z]
        assert all(f.filter(w, NodeView(fleet.devices[z], float(free[z]))).ok for f in fs)
    c = chain_cost(w.profile, parts, {d.id: d for d in fleet.devices}, w.source, w.sink)
    score = SCORE.score(w, ReplicaPlacement(parts, c.latency_s, c.energy_j, c.bottleneck_s))
    assert math.isclose(score, sol.value, rel_tol=1e-9, abs_tol=1e-12) or score == sol.value


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_cached_verdicts_hold_for_each_spec(data: st.DataObject) -> None:
    """Verdicts cached on a snapshot for one workload never decide another's placement."""
    fleet = data.draw(fleets())
    first, second = data.draw(workloads(fleet, "a")), data.draw(workloads(fleet, "b"))
    schedule(fleet, [first])
    warm = schedule(fleet, [second])
    cold = schedule(Fleet(fleet.devices), [second])
    assert warm == cold
