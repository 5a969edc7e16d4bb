"""The chain optimiser is exact: equal to brute force on small random instances."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fog_broker.placement import DeviceTable, PartitionPlacement, chain_cost, solve_chain

from placement_helpers import brute_force, dev, profile, random_instance


def _check(devs, prof, src, snk, obj, K, free=None):  # type: ignore[no-untyped-def]
    tab = DeviceTable.from_devices(devs)
    ids = [d.id for d in devs]
    farr = None if free is None else np.array([free[i] for i in ids])
    sol = solve_chain(tab, prof, src, snk, objective=obj, max_partitions=K, free=farr)
    bf = brute_force(devs, prof, ids[src], ids[snk], obj, K, free)
    if bf is None:
        assert sol is None
        return None
    assert sol is not None and sol.exact
    pl = [PartitionPlacement(f, last, ids[z]) for f, last, z in sol.parts]
    used = [p.device for p in pl]
    assert len(set(used)) == len(used), "chain revisits a device"
    assert all(prof.memory_of(p.first, p.last) <= (free or {}).get(p.device, devs[ids.index(
        p.device)].memory_bytes) for p in pl)
    got = chain_cost(prof, pl, {d.id: d for d in devs}, ids[src], ids[snk]).objective(obj)
    assert got == pytest.approx(bf[0], rel=1e-9, abs=1e-15)
    assert sol.value == pytest.approx(got, rel=1e-9, abs=1e-15)
    return sol


@pytest.mark.parametrize("seed", range(12))
def test_exact_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        devs, prof = random_instance(rng, rng.randint(2, 5), rng.randint(1, 5))
        _check(devs, prof, rng.randrange(len(devs)), rng.randrange(len(devs)),
               rng.choice(["latency", "energy"]), rng.choice([None, None, 1, 2, 3]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_dev=st.integers(2, 5), n_seg=st.integers(1, 5),
       obj=st.sampled_from(["latency", "energy"]), k=st.sampled_from([None, 1, 2, 4]),
       tight=st.booleans())
def test_exact_property(seed: int, n_dev: int, n_seg: int, obj: str, k: int | None,
                        tight: bool) -> None:
    rng = random.Random(seed)
    devs, prof = random_instance(rng, n_dev, n_seg, tight=tight)
    free = {d.id: d.memory_bytes * rng.uniform(0.2, 1.0) for d in devs}
    _check(devs, prof, rng.randrange(n_dev), rng.randrange(n_dev), obj, k, free)


def test_revisit_is_excluded_when_relaxation_wants_it() -> None:
    """A fast device with room for only one small partition at a time must not be used twice."""
    fast = dev("fast", flops=1e12, memory_bytes=2.0e5, uplink_bps=1e9, downlink_bps=1e9, rtt_s=0)
    slow = dev("slow", flops=1e8, memory_bytes=1e7, uplink_bps=1e9, downlink_bps=1e9, rtt_s=0)
    src = dev("src", flops=1e6, memory_bytes=0, uplink_bps=1e9, downlink_bps=1e9, rtt_s=0)
    prof = profile(3, flops=1e9, params=1e5, act=5e4)
    sol = _check([src, fast, slow], prof, 0, 0, "latency", None)
    assert sol is not None and sol.nodes > 1  # the relaxed optimum revisited "fast"


def test_infeasible_returns_none() -> None:
    devs = [dev("a", memory_bytes=10.0), dev("b", memory_bytes=10.0)]
    tab = DeviceTable.from_devices(devs)
    assert solve_chain(tab, profile(3), 0, 1) is None


def test_same_device_source_and_sink_costs_no_transfer() -> None:
    devs = [dev("a", memory_bytes=1e9)]
    tab = DeviceTable.from_devices(devs)
    sol = solve_chain(tab, profile(4), 0, 0)
    assert sol is not None and sol.parts == ((0, 3, 0),)
    assert sol.value == pytest.approx(4e8 / 1e9)
