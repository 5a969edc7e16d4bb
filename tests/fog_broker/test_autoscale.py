"""Autoscaling: the pure policy (windows, hysteresis, bounds) and the controller's scale steps."""
from __future__ import annotations

import math

import pytest
from test_controller import SRC, ack_all, deploys, dev, fleet, reported_of, undeploys, workload

from fog_broker.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Load,
    desired_replicas,
    replicas_for_rate,
)
from fog_broker.controller import Assignment, Controller, Persist, Phase
from fog_broker.placement.model import Autoscale, Fleet, Quota, Workload
from fog_broker.placement.scheduler import schedule
from fog_broker.router import _Rates
from fog_broker.site_core import SetWorkload, SiteCore

CFG = AutoscaleConfig(interval_s=1.0, upscale_delay_s=3.0, downscale_delay_s=10.0)


def load(rps: float, bottleneck: float = 0.1, chains: int = 1) -> Load:
    return Load(offered_rps=rps, shed_rps=0.0, goodput_rps=rps, bottleneck_s=bottleneck, chains=chains,
                outstanding=0)


@pytest.mark.parametrize(("rps", "bottleneck", "target", "want"), [
    (7.0, 0.1, 0.7, 1.0),     # 0.7 chains busy at 70 %: one chain
    (14.0, 0.1, 0.7, 2.0),
    (25.0, 0.1, 0.7, 25 * 0.1 / 0.7),
    (0.0, 0.1, 0.7, 0.0),
])
def test_desired_replicas_is_demand_over_target(rps: float, bottleneck: float, target: float, want: float) -> None:
    assert desired_replicas(load(rps, bottleneck), target) == pytest.approx(want)


def test_unmeasured_load_has_no_opinion() -> None:
    assert math.isnan(desired_replicas(load(50.0, 0.0), 0.7))
    a = Autoscaler(CFG)
    assert all(a.decide("w", load(50.0, 0.0), 1, 1, 3, 0.7, float(t)) is None for t in range(20))


@pytest.mark.parametrize(("rate", "bottleneck", "want"), [(30.0, 0.1, 3), (10.0, 0.1, 1), (10.5, 0.1, 2),
                                                           (5.0, 0.0, 1)])
def test_replicas_for_rate(rate: float, bottleneck: float, want: int) -> None:
    assert replicas_for_rate(rate, bottleneck) == want


def run(a: Autoscaler, loads: list[Load], start: int = 1, lo: int = 1, hi: int = 3, t0: float = 0.0
        ) -> tuple[int, list[tuple[float, int]]]:
    """Feed one load a second; apply each decision; the final count and (time, count) changes."""
    n, changes = start, []
    for i, ld in enumerate(loads):
        d = a.decide("w", ld, n, lo, hi, 0.7, t0 + i)
        if d is not None:
            n = d.replicas
            changes.append((t0 + i, n))
    return n, changes


def test_scales_up_after_the_upscale_delay_not_before() -> None:
    a = Autoscaler(CFG)
    n, changes = run(a, [load(5.0)] * 5 + [load(18.0)] * 10)
    assert n == 3  # 18 req/s x 0.1 s / 0.7 = 2.6 chains
    assert changes[0][0] >= 5 + CFG.upscale_delay_s - 1  # a sustained rise, not the first sample
    assert all(t <= 5 + 6 for t, _ in changes)


def test_a_one_second_spike_does_not_scale() -> None:
    a = Autoscaler(CFG)
    n, changes = run(a, [load(5.0)] * 5 + [load(40.0)] + [load(5.0)] * 10)
    assert (n, changes) == (1, [])


def test_scales_down_one_at_a_time_after_the_longer_delay() -> None:
    a = Autoscaler(CFG)
    n, changes = run(a, [load(2.0)] * 40, start=3)
    assert n == 1
    assert [c for _, c in changes] == [2, 1]
    assert changes[0][0] >= CFG.downscale_delay_s - 1
    assert changes[1][0] - changes[0][0] >= CFG.downscale_delay_s - 1


def test_hysteresis_no_flapping_around_the_target() -> None:
    """Load that needs 1.9 chains at the target keeps 2 and never goes to 1 and back."""
    a = Autoscaler(CFG)
    wobble = [load(13.0 if i % 2 else 13.6) for i in range(60)]  # 1.86..1.94 chains
    n, changes = run(a, wobble, start=2)
    assert (n, changes) == (2, [])


def test_bounds_and_rate_floor() -> None:
    a = Autoscaler(CFG)
    d = a.decide("w", load(100.0), 1, 2, 4, 0.7, 0.0)
    assert d is not None and d.replicas == 2 and "min_replicas" in d.reason
    d = a.decide("w", load(0.0), 5, 1, 4, 0.7, 1.0)
    assert d is not None and d.replicas == 4
    d = a.decide("w", load(0.0), 1, 1, 4, 0.7, 2.0, floor=3)
    assert d is not None and d.replicas == 3 and "rate_fps" in d.reason
    n, _ = run(a, [load(100.0)] * 10, start=3, hi=4, t0=10.0)
    assert n == 4  # never above max_replicas, however high the demand


# ------------------------------------------------------------ the controller's scale steps


def running(c: Controller, f: object, t: float) -> float:
    """Reconcile, ack every deploy, report all running; returns the time after."""
    cmds = c.reconcile(f, reported_of(c), t)  # type: ignore[arg-type]
    ack_all(c, cmds, t + 0.1)
    c.reconcile(f, reported_of(c), t + 0.2)  # type: ignore[arg-type]
    return t + 0.3


def auto_workload(**kw: object) -> Workload:
    return workload(replicas=1, autoscale=Autoscale(1, 3, 0.7), **kw)  # type: ignore[arg-type]


def test_scale_up_adds_a_chain_beside_the_running_one_in_another_power_domain() -> None:
    c = Controller(schedule)
    c.set_workload(auto_workload(), 1)
    f = fleet(SRC, dev("a", domain="p1"), dev("b", domain="p1"), dev("c", domain="p2"), dev("d", domain="p2"))
    t = running(c, f, 0.0)
    first = c.chains("w")
    assert len(first) == 1
    before = {k: a.device for k, a in c.assignments.items()}
    assert c.scale("w", 2, t)
    cmds = c.reconcile(f, reported_of(c), t)
    assert deploys(cmds) and not undeploys(cmds)
    assert all(d.replica == 1 for d in deploys(cmds))
    ack_all(c, cmds, t + 0.1)
    c.reconcile(f, reported_of(c), t + 0.2)
    chains = c.chains("w")
    assert [r for r, _ in chains] == [0, 1]
    assert chains[0] == first[0]  # the running chain did not move
    assert all(c.assignments[k].device == d for k, d in before.items())
    doms = [{f.get(h.device_id).power_domain for h in hops} for _, hops in chains]  # type: ignore[union-attr]
    assert not doms[0] & doms[1]
    assert c.workloads["w"].spec.replicas == 2
    # a later full plan keeps both chains where they are
    c.request_plan()
    assert not undeploys(c.reconcile(f, reported_of(c), t + 1.0))


def test_scale_down_drains_before_undeploy() -> None:
    c = Controller(schedule)
    c.set_workload(auto_workload(), 1)
    f = fleet(SRC, *(dev(x, domain=f"p{x}") for x in "abcdef"))
    t = running(c, f, 0.0)
    c.scale("w", 2, t)
    t = running(c, f, t)
    assert len(c.chains("w")) == 2
    c.scale("w", 1, t)
    assert [r for r, _ in c.chains("w")] == [0]  # replica 1 takes no new request at once
    assert not undeploys(c.reconcile(f, reported_of(c), t + 0.1))  # but keeps running while draining
    assert any(a.replica == 1 for a in c.assignments.values())
    assert c.next_deadline() <= t + c.config.drain_s
    cmds = c.reconcile(f, reported_of(c), t + c.config.drain_s + 0.01)
    gone = undeploys(cmds)
    assert gone and {u.replica for u in gone} == {1}
    assert any(isinstance(x, Persist) for x in cmds)
    assert c.workloads["w"].spec.replicas == 1 and c.workloads["w"].status == "running"
    c.request_plan()
    assert not deploys(c.reconcile(f, reported_of(c), t + 5.0))  # nothing re-placed afterwards


def test_scale_up_that_does_not_fit_says_why_and_keeps_serving() -> None:
    c = Controller(schedule)
    c.set_workload(auto_workload(), 1)
    f = fleet(SRC, dev("a", domain="p1"), dev("b", domain="p1"))  # one power domain: no second replica
    t = running(c, f, 0.0)
    c.scale("w", 2, t)
    c.reconcile(f, reported_of(c), t)
    e = c.workloads["w"]
    assert e.spec.replicas == 1 and c.wanted_replicas("w") == 2
    assert e.scale_reason.startswith("replica 1 does not fit")
    assert len(c.chains("w")) == 1 and e.status == "running"


def test_scale_up_respects_the_tenant_quota() -> None:
    c = Controller(schedule)
    w = auto_workload(tenant="t")
    c.set_workload(w, 1)
    assert w.profile is not None
    one_chain = w.profile.memory_of(0, len(w.profile.segments) - 1)
    c.set_quotas({"t": Quota(one_chain * 1.5)})
    f = fleet(SRC, *(dev(x, domain=f"p{x}") for x in "abcdef"))
    t = running(c, f, 0.0)
    c.scale("w", 2, t)
    assert not deploys(c.reconcile(f, reported_of(c), t))
    assert "quota" in c.workloads["w"].scale_reason


def _scaled_to_two() -> tuple[Controller, Workload, Fleet, float]:
    """An autoscaled workload scaled from one running chain to two running chains."""
    c = Controller(schedule)
    w = auto_workload()
    c.set_workload(w, 1)
    f = fleet(SRC, *(dev(x, domain=f"p{x}") for x in "abcdef"))
    t = running(c, f, 0.0)
    c.scale("w", 2, t)
    return c, w, f, running(c, f, t)


def test_redeploying_the_same_version_keeps_the_scaled_chains() -> None:
    c, w, f, t = _scaled_to_two()
    c.set_workload(w, 1)  # the same text deployed again
    cmds = c.reconcile(f, reported_of(c), t)
    assert not undeploys(cmds) and len(c.chains("w")) == 2
    assert all(a.phase is Phase.RUNNING for a in c.assignments.values())


# ------------------------------------------------------------ the site core: rate_fps and the autoscaler


def _core_with(w: Workload, f: object) -> tuple[SiteCore, float]:
    core = SiteCore(schedule)
    core.handle(SetWorkload(w, 1), 0.0, 0.0)
    c = core.controller
    t = running(c, f, 0.0)
    return core, t


def test_rate_fps_asks_for_the_chains_that_serve_it() -> None:
    """A 4-segment chain of 1e8 FLOP segments on 1e10 FLOP/s devices: the plan's chain takes ~40 ms,
    so 60 frames/s need 3 chains; the site core asks for them and the controller places them."""
    f = fleet(SRC, *(dev(x, domain=f"p{x}") for x in "abcdefgh"))
    core, t = _core_with(workload(rate_fps=60.0), f)
    per_chain = core.chain_seconds("w")
    assert 0.0 < per_chain < 1.0
    need = replicas_for_rate(60.0, per_chain)
    assert need >= 2
    events = core.autoscale(t)
    assert any(getattr(e, "kind", "") == "scaled" for e in events)
    assert core.controller.wanted_replicas("w") == need
    for i in range(need):
        t = running(core.controller, f, t + 0.1 * i)
    assert len(core.controller.chains("w")) == need


def test_rate_fps_no_fleet_can_serve_is_pending_with_the_rate_it_reaches() -> None:
    f = fleet(SRC, dev("a", domain="p1"), dev("b", domain="p1"))  # room for one chain only
    core, t = _core_with(workload(rate_fps=1000.0), f)
    core.autoscale(t)
    running(core.controller, f, t)
    e = core.controller.workloads["w"]
    assert core.controller.wanted_replicas("w") > 1 and e.spec.replicas == 1
    assert e.scale_reason.startswith("replica 1 does not fit")
    assert len(core.controller.chains("w")) == 1  # what fits keeps serving


def test_the_autoscaler_reads_the_routers_load() -> None:
    """Offered load recorded by the router (requests refused for want of chains count too) scales
    an autoscaled workload up, through SiteCore.tick, after the upscale delay."""
    f = fleet(SRC, *(dev(x, domain=f"p{x}") for x in "abcdefgh"))
    core, t = _core_with(auto_workload(), f)
    chains = core.controller.chains("w")
    for h in chains[0][1]:  # the devices report 100 ms per stage
        core.router.note_stage(("w", 1, 0, h.index), 0.1)
    assert core.router.bottleneck_s("w", chains) == pytest.approx(0.1)
    rates = core.router._rates.setdefault("w", _Rates())
    scaled = []
    for i in range(120):  # 20 requests/s offered for 12 s: 2 chains busy at 100 %
        now = t + i * 0.1
        rates.offered.extend((now, now + 0.05))
        if i % 10 == 0:
            scaled += [e for e in core.autoscale(now) if getattr(e, "kind", "") == "scaled"]
    assert scaled and core.controller.wanted_replicas("w") == 3  # 2 chains' load at 70 %: 2.9 -> 3


def test_a_restarted_fog_keeps_the_chains_it_had_scaled_to() -> None:
    """The stored text says min_replicas; the stored assignments say 2 chains ran: both stay, undrained."""
    c, w, f, t = _scaled_to_two()
    stored = [Assignment(a.key, a.device, a.first, a.last, sha256=a.sha256) for a in c.assignments.values()]
    again = Controller(schedule)  # the restarted fog: the spec from its store, then what it had assigned
    again.set_workload(w, 1)
    again.start_after_restart(t, stored)
    cmds = again.reconcile(f, reported_of(c), t + 0.1)
    assert not undeploys(cmds) and again.wanted_replicas("w") == 2
    assert len(again.chains("w")) == 2
