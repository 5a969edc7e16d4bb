"""Deployment controller core with the real (pure) scheduler: no broker, time by hand."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fog_broker.controller import (
    Assignment,
    Controller,
    ControllerConfig,
    DeployPartition,
    Persist,
    Phase,
    UndeployPartition,
)
from fog_broker.placement.model import ChainProfile, Device, Fleet, Quota, Segment, Workload
from fog_broker.placement.scheduler import schedule
from runtime.messages import PartitionStatus

MB = 1_000_000


def dev(i: str, mem: float = 100 * MB, flops: float = 1e10, domain: str | None = None, **kw: object) -> Device:
    labels = (("power-domain", domain or f"pd-{i}"),)
    return Device(id=i, flops=flops, memory_bytes=mem, uplink_bps=1e9, downlink_bps=1e9, rtt_s=0.001,
                  power_active_w=5.0, power_idle_w=0.0, labels=labels, **kw)  # type: ignore[arg-type]


def profile(n: int = 4, param: float = 10 * MB) -> ChainProfile:
    return ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e8, param, 1 * MB, 1000.0) for i in range(n)))


def workload(name: str = "w", **kw: object) -> Workload:
    args: dict = dict(name=name, source="src", sink="src", profile=profile(), model="zoo:x")
    args.update(kw)
    return Workload(**args)


def fleet(*devs: Device) -> Fleet:
    return Fleet(tuple(devs))


def deploys(cmds: list) -> list[DeployPartition]:
    return [c for c in cmds if isinstance(c, DeployPartition)]


def undeploys(cmds: list) -> list[UndeployPartition]:
    return [c for c in cmds if isinstance(c, UndeployPartition)]


def ack_all(c: Controller, cmds: list, now: float) -> None:
    for d in deploys(cmds):
        c.ack(d.command_id, d.device, True, "", now)


def reported_of(c: Controller, health: str = "running") -> dict[str, tuple[PartitionStatus, ...]]:
    out: dict[str, list[PartitionStatus]] = {}
    for a in c.assignments.values():
        out.setdefault(a.device, []).append(PartitionStatus(*a.key, sha256=a.sha256 or "0" * 64, health=health))
    out.setdefault("src", [])  # every live device with a state advert is in the report
    return {k: tuple(v) for k, v in out.items()}


# small source device that cannot host (memory 0) so partitions go elsewhere
SRC = dev("src", mem=0.0, flops=1e6)


def test_deploy_ack_running_and_chains() -> None:
    c = Controller(schedule)
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a"), dev("b"))
    cmds = c.reconcile(f, {}, 0.0)
    ds = deploys(cmds)
    assert ds and {d.workload for d in ds} == {"w"}
    assert any(isinstance(x, Persist) for x in cmds)
    assert c.chains("w") == []
    ack_all(c, cmds, 0.1)
    chains = c.chains("w")
    assert len(chains) == 1 and chains[0][0] == 0
    assert [h.device_id for h in chains[0][1]] == [d.device for d in ds]
    c.reconcile(f, {}, 0.2)
    assert c.workloads["w"].status == "running"
    assert c.deploy_latencies and c.deploy_latencies[0] == pytest.approx(0.1)


def test_no_ack_retries_with_backoff_then_moves() -> None:
    cfg = ControllerConfig(ack_timeout_s=1.0, backoff_s=0.5, max_attempts=3, transfer_safety=0.0)
    c = Controller(schedule, cfg)
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a"), dev("b", flops=1e9))
    first = deploys(c.reconcile(f, {}, 0.0))
    assert [d.device for d in first] == ["a"]
    assert deploys(c.reconcile(f, {}, 0.9)) == []
    assert deploys(c.reconcile(f, {}, 1.0)) == []  # timed out: backoff 0.5 s
    again = deploys(c.reconcile(f, {}, 1.5))
    assert [(d.device, d.attempt) for d in again] == [("a", 2)]
    assert deploys(c.reconcile(f, {}, 2.5)) == []  # timeout -> backoff 1 s
    third = deploys(c.reconcile(f, {}, 3.5))
    assert [(d.device, d.attempt) for d in third] == [("a", 3)]
    moved = c.reconcile(f, {}, 4.5)  # third timeout: give up on a, repair elsewhere
    assert [d.device for d in deploys(moved)] == ["b"]
    assert [u.device for u in undeploys(moved)] == ["a"]


def test_nack_is_retried_and_old_acks_are_ignored() -> None:
    c = Controller(schedule, ControllerConfig(backoff_s=0.5))
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a"))
    (d,) = deploys(c.reconcile(f, {}, 0.0))
    assert c.ack(d.command_id, "a", False, "load failed", 0.1) == []
    assert c.counters["nacks"] == 1
    (d2,) = deploys(c.reconcile(f, {}, 0.7))
    c.ack(d.command_id, "a", True, "", 0.8)  # the superseded attempt
    assert c.chains("w") == []
    c.ack(d2.command_id, "a", True, "", 0.9)
    assert len(c.chains("w")) == 1


def test_lost_partition_is_replaced_with_the_same_segments_only() -> None:
    c = Controller(schedule)
    # two devices each fit only half of the model: the chain has two partitions
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a", mem=25 * MB), dev("b", mem=25 * MB), dev("c", mem=25 * MB, flops=5e9))
    cmds = c.reconcile(f, {}, 0.0)
    ack_all(c, cmds, 0.1)
    before = {a.key: (a.device, a.first, a.last) for a in c.assignments.values()}
    assert len(before) == 2
    victim = sorted(before.values())[0][0]
    c.device_lost(victim, 1.0)
    f2 = fleet(*[replace(d, alive=d.id != victim) for d in f.devices])
    cmds = c.reconcile(f2, {}, 1.0)
    (d,) = deploys(cmds)
    assert d.device == "c"
    after = {a.key: (a.device, a.first, a.last) for a in c.assignments.values()}
    for key, (device, first, last) in before.items():
        if device == victim:
            assert after[key] == ("c", first, last)
        else:
            assert after[key] == (device, first, last)  # healthy partition untouched
    assert not undeploys(cmds)
    c.ack(d.command_id, "c", True, "", 1.2)
    assert c.recoveries == [pytest.approx(0.2)]
    assert len(c.chains("w")) == 1


def test_replica_promotion_is_immediate_and_count_is_restored() -> None:
    c = Controller(schedule)
    c.set_workload(workload(replicas=2), 1)
    f = fleet(SRC, dev("a"), dev("b"), dev("c", flops=1e9))
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    chains = c.chains("w")
    assert [r for r, _ in chains] == [0, 1]
    primary_dev = chains[0][1][0].device_id
    c.device_lost(primary_dev, 1.0)
    assert [r for r, _ in c.chains("w")] == [1]  # the replica serves at once
    f2 = fleet(*[replace(d, alive=d.id != primary_dev) for d in f.devices])
    cmds = c.reconcile(f2, {}, 1.0)
    (d,) = deploys(cmds)
    assert d.device == "c" and d.replica == 0
    c.ack(d.command_id, "c", True, "", 1.1)
    assert [r for r, _ in c.chains("w")] == [0, 1]


def _ready(c: Controller) -> bool:
    """A call, so mypy does not narrow ``ready`` across the passes that change it."""
    return c.ready


def test_restart_adopts_running_partitions_without_redeploying() -> None:
    c1 = Controller(schedule)
    c1.set_workload(workload(), 1)
    f = fleet(SRC, dev("a", mem=25 * MB), dev("b", mem=25 * MB))
    ack_all(c1, c1.reconcile(f, {}, 0.0), 0.1)
    for a in c1.assignments.values():
        a.sha256 = "ab" * 32
    stored = [Assignment(a.key, a.device, a.first, a.last, sha256=a.sha256) for a in c1.assignments.values()]
    reported = reported_of(c1)

    c2 = Controller(schedule, ControllerConfig(startup_wait_s=10.0))
    c2.set_workload(workload(), 1)
    c2.start_after_restart(100.0, stored)
    assert c2.reconcile(f, {}, 100.1) == []  # nobody heard yet: wait
    partial = {k: v for k, v in reported.items() if k != "src"}
    assert c2.reconcile(f, partial, 100.2) == [] and not _ready(c2)  # the source is not heard yet
    cmds = c2.reconcile(f, reported, 100.5)
    assert deploys(cmds) == [] and undeploys(cmds) == []
    assert c2.ready and len(c2.chains("w")) == 1
    assert all(a.phase is Phase.RUNNING for a in c2.assignments.values())


def test_restart_redeploys_only_what_is_missing() -> None:
    c1 = Controller(schedule)
    c1.set_workload(workload(), 1)
    f = fleet(SRC, dev("a", mem=25 * MB), dev("b", mem=25 * MB))
    ack_all(c1, c1.reconcile(f, {}, 0.0), 0.1)
    stored = [Assignment(a.key, a.device, a.first, a.last) for a in c1.assignments.values()]
    reported = reported_of(c1)
    lost_dev = sorted(reported)[0]
    reported[lost_dev] = ()  # that device restarted and lost its partition
    c2 = Controller(schedule, ControllerConfig(startup_wait_s=10.0))
    c2.set_workload(workload(), 1)
    c2.start_after_restart(0.0, stored)
    cmds = c2.reconcile(f, reported, 0.5)
    assert [d.device for d in deploys(cmds)] == [lost_dev]


def test_orphan_partitions_are_undeployed_after_grace() -> None:
    c = Controller(schedule, ControllerConfig(orphan_grace_s=1.0))
    f = fleet(SRC, dev("a"))
    rep = {"a": (PartitionStatus("ghost", 3, 0, 0, "0" * 64, "running"),)}
    assert c.reconcile(f, rep, 0.0) == []
    (u,) = undeploys(c.reconcile(f, rep, 1.5))
    assert (u.device, u.workload, u.version) == ("a", "ghost", 3)
    assert undeploys(c.reconcile(f, rep, 2.0)) == []  # not every tick


def test_priority_preempts_lower_priority_work() -> None:
    c = Controller(schedule)
    f = fleet(SRC, dev("a", mem=50 * MB))
    c.set_workload(workload("low", priority=0), 1)
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    assert c.workloads["low"].status == "running"
    c.set_workload(workload("high", priority=10), 1)
    cmds = c.reconcile(f, {}, 1.0)
    assert {u.workload for u in undeploys(cmds)} == {"low"}
    assert {d.workload for d in deploys(cmds)} == {"high"}
    assert c.workloads["low"].status == "pending"
    assert "preempted" in c.workloads["low"].reasons
    assert "low" in c.evicted


def test_quota_keeps_a_workload_pending_with_a_reason() -> None:
    c = Controller(schedule)
    c.set_quotas({"t": Quota(10 * MB)})
    c.set_workload(workload(tenant="t"), 1)
    cmds = c.reconcile(fleet(SRC, dev("a")), {}, 0.0)
    assert deploys(cmds) == []
    assert c.workloads["w"].status == "pending"
    assert "quota" in c.workloads["w"].reasons


def test_new_version_is_made_before_the_old_one_breaks() -> None:
    """Scenarios (rolling, break-before-make, faults, restarts) are in test_controller_switch.py."""
    c = Controller(schedule, ControllerConfig(drain_s=1.0))
    f = fleet(SRC, dev("a"))
    c.set_workload(workload(), 1)
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    cmds = c.set_workload(workload(), 2)
    assert undeploys(cmds) == []  # v1 serves on
    ds = deploys(c.reconcile(f, {}, 0.5))
    assert ds and {d.version for d in ds} == {2}
    assert {h.version for _, chain in c.chains("w") for h in chain} == {1}
    ack_all(c, ds, 0.6)
    assert undeploys(c.reconcile(f, {}, 0.7)) == []  # v2 serves, v1 drains
    assert {h.version for _, chain in c.chains("w") for h in chain} == {2}
    assert {u.version for u in undeploys(c.reconcile(f, {}, 1.7))} == {1}
    c.reconcile(f, {}, 1.8)
    assert c.switches == {}


def test_reported_running_confirms_a_deploy_whose_ack_was_lost() -> None:
    c = Controller(schedule)
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a"))
    c.reconcile(f, {}, 0.0)
    c.reconcile(f, reported_of(c), 0.3)
    assert len(c.chains("w")) == 1


def test_partition_missing_from_reports_is_redeployed() -> None:
    c = Controller(schedule, ControllerConfig(missing_grace_s=1.0))
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a"))
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    assert deploys(c.reconcile(f, {"a": ()}, 2.0)) == []
    (d,) = deploys(c.reconcile(f, {"a": ()}, 3.1))
    assert d.device == "a"


def test_a_serving_workload_is_not_dropped_when_it_cannot_be_planned() -> None:
    """Its source going away (or any non-preemption reason) must not tear down running partitions."""
    c = Controller(schedule)
    f = fleet(SRC, dev("a"))
    c.set_workload(workload(), 1)
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    c.set_workload(workload(priority=1), 1)  # forces a re-plan
    cmds = c.reconcile(fleet(dev("a")), {}, 1.0)  # the source is not in the fleet
    assert undeploys(cmds) == [] and len(c.chains("w")) == 1
    assert "source" in c.workloads["w"].reasons


def test_next_deadline_tracks_retries_and_startup() -> None:
    c = Controller(schedule, ControllerConfig(ack_timeout_s=2.0, transfer_safety=0.0))
    c.set_workload(workload(), 1)
    c.reconcile(fleet(SRC, dev("a")), {}, 0.0)
    assert c.next_deadline() == 2.0


def test_healthy_replica_survives_an_unrepairable_loss() -> None:
    c = Controller(schedule)
    c.set_workload(workload(replicas=2), 1)
    f = fleet(SRC, dev("a"), dev("b"))
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    assert [r for r, _ in c.chains("w")] == [0, 1]
    victim = c.chains("w")[0][1][0].device_id
    c.device_lost(victim, 1.0)
    f2 = fleet(*[replace(d, alive=d.id != victim) for d in f.devices])
    for t in (1.0, 1.5, 7.0):
        cmds = c.reconcile(f2, {}, t)
        assert undeploys(cmds) == [] and deploys(cmds) == []
        assert len(c.chains("w")) == 1, t
    # a device comes back: only the lost partition is re-placed
    f3 = fleet(*f2.devices, dev("c"))
    cmds = c.reconcile(f3, {}, 8.0)
    assert [d.device for d in deploys(cmds)] == ["c"] and not undeploys(cmds)


def _two_running_replicas(f: Fleet) -> Controller:
    """A 2-replica, 2-partition workload placed on ``f`` and running (every deploy acked)."""
    c = Controller(schedule)
    c.set_workload(workload(replicas=2, min_partitions=2, max_partitions=2), 1)
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    return c


def test_a_repair_stays_in_the_power_domains_its_replica_already_uses() -> None:
    """Replicas keep off each other's power domains, so a repair that takes a fresh domain leaves
    the other replica one fewer to repair into (the chaos test once lost its second replica for
    good that way). A spare in the chain's own domain wins over a faster one in a new domain;
    with no such spare the new domain is used."""
    f = fleet(SRC, *(dev(n) for n in "abcd"))
    c = _two_running_replicas(f)
    chain0 = [h.device_id for h in dict(c.chains("w"))[0]]
    keep, victim = chain0
    domain = {d.id: d.power_domain for d in f.devices}
    c.device_lost(victim, 1.0)
    spares = (dev("same", domain=domain[keep]), dev("fresh", flops=1e11, domain="pd-new"))
    f2 = fleet(*[replace(d, alive=d.id != victim) for d in f.devices], *spares)
    assert [d.device for d in deploys(c.reconcile(f2, {}, 1.5))] == ["same"]
    # no spare in the chain's domains: a new domain it is
    c2 = _two_running_replicas(f)
    c2.device_lost(victim, 1.0)
    f3 = fleet(*[replace(d, alive=d.id != victim) for d in f.devices], spares[1])
    assert [d.device for d in deploys(c2.reconcile(f3, {}, 1.5))] == ["fresh"]


def test_a_device_that_died_and_came_back_takes_its_lost_partition_again() -> None:
    """Replica 1 can only live on its own power domains; one of its devices dies and no other
    device may take the partition. When the device rejoins, the partition is deployed on it
    again (before, it stayed lost for good: the repair never went back to the device it was
    lost on, and a whole re-plan kept the lost assignment as it was)."""
    f = fleet(SRC, *(dev(n) for n in "abcd"))
    c = _two_running_replicas(f)
    victim = dict(c.chains("w"))[1][0].device_id
    c.device_lost(victim, 1.0)
    f2 = fleet(*[replace(d, alive=d.id != victim) for d in f.devices])
    assert deploys(c.reconcile(f2, reported_of(c), 1.5)) == []  # nowhere to go while it is away
    assert len(c.chains("w")) == 1
    cmds = c.reconcile(f, reported_of(c), 3.0)                  # it is back
    assert [d.device for d in deploys(cmds)] == [victim]
    ack_all(c, cmds, 3.1)
    assert [r for r, _ in c.chains("w")] == [0, 1]


def test_a_partition_that_failed_on_a_device_is_not_sent_back_to_it() -> None:
    c = Controller(schedule)
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a"), dev("b"))
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    a = c.assignments_of("w")[0]
    failed = {**reported_of(c), a.device: (PartitionStatus(*a.key, sha256=a.sha256 or "0" * 64,
                                                           health="failed"),)}
    moved = [d.device for d in deploys(c.reconcile(f, failed, 1.0))]
    assert a.device not in moved


def test_a_replanned_key_on_the_same_device_ignores_reports_of_the_old_partition() -> None:
    from fog_broker.placement.plan import PartitionPlacement, ReplicaPlacement

    c = Controller(schedule)
    c.set_workload(workload(), 1)
    f = fleet(SRC, dev("a"), dev("b"))
    ack_all(c, c.reconcile(f, {}, 0.0), 0.1)
    old = c.assignments_of("w")[0]
    old_report = {old.device: (PartitionStatus(*old.key, sha256="1" * 64, health="running"),), "src": ()}
    old.sha256 = "1" * 64
    # re-plan: same key (replica 0, index 0) on the same device, other segments
    new = ReplicaPlacement((PartitionPlacement(0, 0, old.device), PartitionPlacement(1, 3, "b")), 0.0, 0.0)
    cmds = c.applier.apply(c.workloads["w"], [new], 1.0, float("nan"))
    assert [u.device for u in undeploys(cmds)] == [old.device]
    c.reconcile(f, old_report, 1.1)  # the device still lists the old partition under the same key
    a = c.assignments[old.key]
    assert a.phase is not Phase.RUNNING and (a.first, a.last) == (0, 0)
    assert not undeploys(c.reconcile(f, old_report, 10.0))  # not an orphan either
    c.note_sha(old.key, "2" * 64)  # the new artifact is built
    new_report = {old.device: (PartitionStatus(*old.key, sha256="2" * 64, health="running"),), "src": ()}
    c.reconcile(f, new_report, 11.0)
    assert c.assignments[old.key].phase is Phase.RUNNING


def _phases(c: Controller) -> list[Phase]:
    """A call, so mypy does not narrow a phase across the passes that change it."""
    return [a.phase for a in c.assignments.values()]


def _slow_site() -> tuple[Controller, Fleet]:
    """One 10 MB partition for a device that advertises a 1 Mbit/s downlink (80 s to send)."""
    c = Controller(schedule, ControllerConfig(ack_timeout_s=5.0, backoff_s=0.5, max_attempts=2))
    c.set_workload(workload(profile=profile(n=1, param=10 * MB)), 1)
    return c, fleet(SRC, replace(dev("slow"), downlink_bps=1e6))


def test_a_slow_downlink_deploy_is_not_resent_before_it_can_arrive() -> None:
    c, f = _slow_site()
    (d,) = deploys(c.reconcile(f, {}, 0.0))
    assert d.device == "slow"
    for t in (5.0, 6.0, 60.0, 150.0):  # the fixed 5 s would have resent (and given up) by now
        assert deploys(c.reconcile(f, {}, t)) == []
    assert c.counters["retries"] == 0
    assert c.next_deadline() == pytest.approx(5.0 + 2 * 80.0)
    c.ack(d.command_id, "slow", True, "", 90.0)
    assert len(c.chains("w")) == 1


def test_a_device_that_never_acks_is_retried_at_the_scaled_deadline() -> None:
    c, f = _slow_site()
    c.reconcile(f, {}, 0.0)
    (a,) = c.assignments.values()
    assert deploys(c.reconcile(f, {}, 164.9)) == []
    assert _phases(c) == [Phase.DEPLOYING]
    c.reconcile(f, {}, 165.0)
    assert _phases(c) == [Phase.PENDING] and a.reason == "no ack from slow within 165 s"
    (again,) = deploys(c.reconcile(f, {}, 165.5))
    assert (again.device, again.attempt) == ("slow", 2)
    c.reconcile(f, {}, 165.5 + 165.0)  # max_attempts: given up, the reason says after how long
    assert "gave up on slow after 2 attempts: no ack from slow within 165 s" in a.reason
