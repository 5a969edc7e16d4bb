"""Issue 20 finding 5, the scheduler's side: a flagged capacity claim decides no first replica.

Before: a device whose claim was flagged (or far above its measured compute) was scheduled on its
claim like any other, and got replica 0 of the next workload. Now ``VerifiedLead`` keeps it off
every first (or only) replica, on the vectorised path the scheduler runs and in the per-node
plugin verdict alike, and a running first replica on it is moved.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fog_broker"))

from fog_broker.placement import Fleet, Workload, schedule, validate_plan
from fog_broker.placement.plugins import UNVERIFIED, NodeView, VerifiedLead

from placement_helpers import dev, profile

SRC = dev("src", memory_bytes=0.0)


def wl(name: str, replicas: int = 1, **kw: object) -> Workload:
    return Workload(name=name, source="src", sink="src", profile=profile(3), replicas=replicas,
                    **kw)  # type: ignore[arg-type]


def site(*, liar_verified: bool) -> Fleet:
    liar = dev("liar", flops=4.9e14, labels=(("power-domain", "p0"),), verified=liar_verified)
    honest = [dev(f"h{i}", labels=(("power-domain", f"p{i + 1}"),)) for i in range(3)]
    return Fleet((SRC, liar, *honest))


def devices_of(plan: object, name: str, replica: int) -> set[str]:
    r = plan.result(name)  # type: ignore[attr-defined]
    return {p.device for p in r.replicas[replica].partitions}


def test_the_claim_wins_replica_0_when_it_is_not_flagged() -> None:
    """The baseline the rule changes: the biggest claim gets the first replica."""
    fl = site(liar_verified=True)
    plan = schedule(fl, [wl("w")])
    assert "liar" in devices_of(plan, "w", 0)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_flagged_device_holds_no_first_or_only_replica(replicas: int) -> None:
    fl = site(liar_verified=False)
    w = wl("w", replicas)
    plan = schedule(fl, [w])
    assert plan.result("w").placed
    assert "liar" not in devices_of(plan, "w", 0)
    assert validate_plan(plan, fl, [w]) == []


def test_a_flagged_device_may_still_hold_a_later_replica() -> None:
    # only two domains besides the liar's: replica 1 of 2 must use it or a second honest domain
    liar = dev("liar", flops=4.9e14, labels=(("power-domain", "p0"),), verified=False)
    fl = Fleet((SRC, liar, dev("h", labels=(("power-domain", "p1"),))))
    plan = schedule(fl, [wl("w", 2)])
    assert plan.result("w").placed
    assert devices_of(plan, "w", 0) == {"h"} and devices_of(plan, "w", 1) == {"liar"}


def test_only_flagged_devices_leave_the_workload_pending_with_the_reason() -> None:
    liar = dev("liar", flops=4.9e14, verified=False)
    fl = Fleet((SRC, liar))
    plan = schedule(fl, [wl("w")])
    r = plan.result("w")
    assert r.status == "pending"
    assert "verified" in r.reason_map and r.detail_map["histogram"][UNVERIFIED] == 1


def test_a_running_first_replica_moves_off_a_device_once_it_is_flagged() -> None:
    fl = site(liar_verified=True)
    w = wl("w", 2)
    first = schedule(fl, [w])
    assert "liar" in devices_of(first, "w", 0)
    current = {"w": first.result("w").placement}
    assert schedule(fl, [w], current=current).result("w").kept  # unchanged fleet: kept as it runs
    flagged = site(liar_verified=False)
    again = schedule(flagged, [w], current=current)
    assert not again.result("w").kept
    assert "liar" not in devices_of(again, "w", 0)
    assert validate_plan(again, flagged, [w]) == []


def test_the_plugin_and_the_vectorised_mask_agree() -> None:
    fl = site(liar_verified=False)
    w = wl("w")
    free = np.array([d.memory_bytes for d in fl.devices])
    for replica in (0, 1):
        plugin = VerifiedLead(replica)
        mask = plugin.batch(w, fl, free)
        verdicts = np.array([plugin.filter(w, NodeView(d, d.memory_bytes)).ok for d in fl.devices])
        assert (mask == verdicts).all()
    assert not VerifiedLead(0).batch(w, fl, free)[fl.index["liar"]]
    assert replace(fl.devices[1], verified=True).verified
