"""A stage whose measured time no longer meets the plan is re-placed, without flapping.

The rule (``fog_broker.slow_stages``) is a table of p50s against planned times; ``SiteCore`` feeds it
the devices' state adverts, sets a slow device aside (the scheduler sees it as throttled) and the
running stage moves; after its hold the device takes work again, and a device slow again is held
twice as long. The device never reports ``throttled``: only its measured times give it away.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from fog_broker.claim_check import ClaimCheckConfig
from fog_broker.controller import DeployPartition, UndeployPartition
from fog_broker.placement.model import ChainProfile, Segment, Workload
from fog_broker.placement.scheduler import schedule
from fog_broker.registry import CLAIM_REFUTED, capacity_flags
from fog_broker.router import SendActivation
from fog_broker.site_core import (
    Ack,
    Advert,
    Infer,
    Result,
    SetWorkload,
    SiteCore,
    SiteCoreConfig,
    SiteEvent,
)
from fog_broker.slow_stages import (
    SetAside,
    SlowStageConfig,
    SlowStages,
    StageSample,
    planned_stage_s,
)
from runtime.errors import LocalViolation
from runtime.messages import (
    DeviceBirth,
    DeviceState,
    InferenceRequest,
    InferenceResult,
    PartitionStatus,
)

MB = 1_000_000
KEY = ("w", 1, 0, 0)
CFG = SlowStageConfig(factor=2.0, recover=1.25, sustain=3, hold_s=10.0, max_hold_s=40.0, min_excess_s=0.01)


def feed(rule: SlowStages, p50s: Sequence[float], *, planned: float = 0.1, start: int = 0,
         now: float = 0.0, step: int = 10) -> list[SetAside]:
    """One advert per p50, each with ``step`` more requests served."""
    out = []
    for i, p50 in enumerate(p50s):
        got = rule.observe("a", [StageSample(KEY, start + i * step, p50, planned)], now + i)
        if got is not None:
            out.append(got)
    return out


def test_a_sustained_slow_stage_sets_its_device_aside_with_the_reason() -> None:
    rule = SlowStages(CFG)
    assert feed(rule, [0.1, 0.3, 0.3]) == []             # the first advert only opens the window
    (got,) = feed(rule, [0.4], start=30, now=3.0)
    assert got.device == "a" and got.key == KEY and got.until == 13.0
    assert got.reason == ("w v1 replica 0 stage 0: measured p50 400.0 ms, 4.0x the plan's 100.0 ms in 3 "
                          "adverts; set aside 10 s")
    assert rule.set_aside == {"a": got.reason} and rule.next_deadline() == 13.0


@pytest.mark.parametrize("p50s, why", [
    ([0.1, 0.3, 0.3, 0.1, 0.3, 0.3], "a healthy advert resets the streak"),
    ([0.1, 0.3, 0.3, 0.19], "two slow adverts are not sustained"),
    ([0.004, 0.012, 0.012, 0.012, 0.012], "3x, but under min_excess_s: not worth a move"),
])
def test_not_sustained_not_set_aside(p50s: list[float], why: str) -> None:
    planned = 0.1 if "min_excess" not in why else 0.004
    assert feed(SlowStages(CFG), p50s, planned=planned) == [], why


def test_the_band_between_recover_and_factor_neither_counts_nor_resets() -> None:
    """Hysteresis: a p50 hovering at 1.5x the plan keeps the streak where it was."""
    rule = SlowStages(CFG)
    assert feed(rule, [0.1, 0.3, 0.15, 0.3, 0.15]) == []
    assert len(feed(rule, [0.3], start=50, now=5.0)) == 1


def test_a_window_that_did_not_move_or_a_redeploy_says_nothing_new() -> None:
    rule = SlowStages(CFG)
    assert feed(rule, [0.1, 0.3, 0.3, 0.3, 0.3, 0.3], step=0) == []      # no new requests served
    assert feed(rule, [0.3, 0.3], start=100) == []
    assert rule.observe("a", [StageSample(KEY, 5, 0.3, 0.1)], 9.0) is None  # served went down: redeployed
    assert feed(rule, [0.3, 0.3], start=15) == []                        # a fresh streak: 2 so far
    assert feed(rule, [0.0, 0.3], start=100, planned=0.0) == []           # no plan time: no yardstick


def test_backoff_doubles_the_hold_and_health_forgives_it() -> None:
    rule = SlowStages(CFG)
    holds = []
    now, served = 0.0, 0
    for _ in range(4):
        got = feed(rule, [0.1, 0.3, 0.3, 0.3], start=served, now=now)
        served += 40
        assert len(got) == 1
        holds.append(got[0].until - (now + 3))
        assert rule.tick(got[0].until - 0.001) == [] and rule.tick(got[0].until) == ["a"]
        assert rule.set_aside == {} and rule.next_deadline() == math.inf
        now = got[0].until + 1
    assert holds == [10.0, 20.0, 40.0, 40.0]                             # capped at max_hold_s
    assert feed(rule, [0.1, 0.1, 0.1, 0.1], start=served, now=now) == []  # three healthy adverts
    (again,) = feed(rule, [0.3, 0.3, 0.3], start=served + 40, now=now + 10)
    assert again.until - (now + 12) == 10.0  # strikes forgiven: the first hold again


def test_planned_time_is_the_devices_own_measured_times_then_its_calibration() -> None:
    times = {"dev-1": (0.01, 0.02, 0.03), "class:pi4": (1e-6,) * 3, "pi4": (1e-6,) * 3}
    assert planned_stage_s(times, "dev-1", 1, 2, 0.5) == pytest.approx(0.05)
    assert planned_stage_s(times, "dev-2", 1, 2, 0.5) == 0.5  # never its class's (or anyone's) times
    assert planned_stage_s({}, "dev-1", 0, 0, 0.0) == 0.0


@pytest.mark.parametrize("kw", [dict(factor=1.2, recover=1.25), dict(recover=0.9), dict(sustain=0),
                                dict(hold_s=0.0), dict(hold_s=50.0, max_hold_s=40.0), dict(min_excess_s=-1.0),
                                dict(factor=math.nan)])
def test_config_is_checked(kw: dict[str, float]) -> None:
    with pytest.raises(LocalViolation):
        SlowStageConfig(**kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- SiteCore

#: ``src`` holds nothing; ``a`` is faster than ``b``, so every objective prefers it
HARDWARE = {"src": (1e6, 1), "a": (2e10, 100 * MB), "b": (1e10, 100 * MB)}
PLANNED = {"a": 0.1, "b": 0.2}  # the one-partition chain's compute: 2e9 FLOPs on each


def birth(dev: str) -> DeviceBirth:
    flops, mem = HARDWARE[dev]
    return DeviceBirth(device_id=dev, epoch=1, seq=1, site="s", public_key=bytes(32), flops=flops,
                       memory_bytes=mem, uplink_bps=1e8, downlink_bps=1e8, rtt_s=1e-3,
                       power_active_w=5.0, power_idle_w=1.0, tx_j_per_byte=1e-8,
                       rx_j_per_byte=1e-8, state_interval_s=1.0)


def workload(name: str = "w") -> Workload:
    prof = ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e9, 1 * MB, 1 * MB, 1000.0) for i in range(2)))
    return Workload(name=name, source="src", sink="src", profile=prof)


class Site:
    """A SiteCore and fake devices that deploy, ack, serve and advertise what they measured."""

    def __init__(self, claims: ClaimCheckConfig | None = None) -> None:
        self.core = SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0, slow_stages=CFG,
                                                      claims=claims or ClaimCheckConfig()))
        self.reported = dict(PLANNED)  # what each device says its stage takes (a liar: far less)
        self.sent: list[SendActivation] = []
        self.now = 0.0
        self.running: dict[str, dict[tuple[str, int, int, int], int]] = {d: {} for d in HARDWARE}  # -> served
        self.slowdown = dict.fromkeys(HARDWARE, 1.0)
        self.seq = dict.fromkeys(HARDWARE, 1)
        self.events: list[SiteEvent] = []
        for d in HARDWARE:
            self.carry(self.core.handle(Advert(birth(d)), self.now))

    def carry(self, cmds: Sequence[object]) -> None:
        queue = list(cmds)
        while queue:
            c = queue.pop(0)
            if isinstance(c, SiteEvent):
                self.events.append(c)
            elif isinstance(c, SendActivation):
                self.sent.append(c)
            elif isinstance(c, DeployPartition):
                self.running[c.device][(c.workload, c.version, c.replica, c.index)] = 0
                queue += self.core.handle(Ack(c.device, c.command_id, True, ""), self.now)
            elif isinstance(c, UndeployPartition):
                self.running[c.device].pop((c.workload, c.version, c.replica, c.index), None)

    def step(self) -> None:
        """Half a second: every device serves 20 requests per partition and advertises, then a tick."""
        self.now += 0.5
        for d in HARDWARE:
            self.seq[d] += 1
            parts = []
            for key in self.running[d]:
                self.running[d][key] += 20
                parts.append(PartitionStatus(*key, sha256="0" * 64, health="running",
                                             p50_s=self.reported.get(d, 0.0) * self.slowdown[d],
                                             served=self.running[d][key], calib_s=self.reported.get(d, 0.0)))
            msg = DeviceState(device_id=d, epoch=1, seq=self.seq[d], free_memory_bytes=HARDWARE[d][1],
                              partitions=tuple(parts))
            self.carry(self.core.handle(Advert(msg), self.now))
        self.carry(self.core.tick(self.now, 1e9 + self.now))

    def until(self, done: object, limit_s: float = 30.0) -> None:
        deadline = self.now + limit_s
        while self.now < deadline and not done():  # type: ignore[operator]
            self.step()
        assert done(), (self.running, self.events)  # type: ignore[operator]


def test_site_re_places_a_stage_whose_device_slowed_down_and_takes_it_back_after_the_hold() -> None:
    site = Site()
    site.carry(site.core.handle(SetWorkload(workload(), 1), site.now))
    site.until(lambda: site.running["a"] and not site.running["b"])
    for _ in range(10):  # at the plan's pace nothing moves
        site.step()
    assert site.running["a"] and not any(e.kind == "stage slow" for e in site.events)

    site.slowdown["a"] = 4.0  # heat: the board does not say so, its p50 does
    t0 = site.now
    site.until(lambda: site.running["b"] and not site.running["a"])
    (slow,) = [e for e in site.events if e.kind == "stage slow"]
    assert slow.device == "a" and "measured p50 400.0 ms, 4.0x the plan's 100.0 ms" in slow.reason
    assert site.core.slow_stages.set_aside == {"a": slow.reason}
    assert site.core.counters["stages_slow"] == 1
    assert site.now - t0 <= 3.0  # sustain 3 adverts, re-placed at once

    site.slowdown["a"] = 1.0  # cooled down; the hold (10 s) ends and it takes work again
    site.until(lambda: any(e.kind == "device usable again" and e.device == "a" for e in site.events))
    assert site.core.slow_stages.set_aside == {} and site.now - t0 >= CFG.hold_s
    assert site.running["b"]  # what runs stays put (no churn): new work goes to the better device
    site.carry(site.core.handle(SetWorkload(workload("w2"), 1), site.now))
    site.until(lambda: ("w2", 1, 0, 0) in site.running["a"])


def test_a_stage_in_the_band_does_not_flap() -> None:
    site = Site()
    site.carry(site.core.handle(SetWorkload(workload(), 1), site.now))
    site.until(lambda: bool(site.running["a"]))
    for i in range(40):  # isolated 3x spikes between healthy and in-band adverts
        site.slowdown["a"] = (1.0, 1.9, 3.0, 1.2, 1.5)[i % 5]
        site.step()
    assert site.running["a"] and not site.running["b"]
    assert not any(e.kind == "stage slow" for e in site.events)


def test_a_device_reporting_50us_for_a_100ms_stage_is_refuted_by_the_routers_round_trips() -> None:
    """Calibration poisoning: ``a`` reports 50 µs (below the floor that triggers a measurement) for a
    stage that takes it 100 ms. The router times every answer: the claim is refuted, ``a`` is flagged
    (no first replica), its times become the observed ones, and the honest ``b`` is never judged by it."""
    site = Site(ClaimCheckConfig(alone_s=0.05, samples=5, span_s=0.3))
    site.reported["a"] = 0.00005
    site.carry(site.core.handle(SetWorkload(workload(), 1), site.now))
    site.until(lambda: site.running["a"] and not site.running["b"])
    site.step()  # its first advert: the 50 µs it reports reaches the router
    for i in range(8):  # requests answered by a after its real 100 ms
        site.sent.clear()
        req = InferenceRequest(f"q{i}", "w", "fogline/v1/s/reply/app", {}, 5.0)
        site.carry(site.core.handle(Infer(req, 1e9 + site.now), site.now))
        (act,) = site.sent
        assert act.device == "a"
        site.now += 0.1
        res = InferenceResult(act.activation.request_id, True, {}, "", "a", 0, 0.1)
        site.carry(site.core.handle(Result(res, "a", 1e9 + site.now), site.now))
    (refuted,) = [e for e in site.events if e.kind == "timings refuted"]
    assert refuted.device == "a" and "claimed 0.05 ms" in refuted.reason and "100.0 ms" in refuted.reason
    assert site.core.counters["timings_refuted"] == 1
    rec = site.core.registry.devices
    assert CLAIM_REFUTED in capacity_flags(rec["a"]) and not capacity_flags(rec["b"])
    def times() -> dict[str, tuple[float, ...]]:
        profile = site.core.controller.workloads["w"].spec.profile
        assert profile is not None
        return dict(profile.segment_times)
    assert sum(times()["a"]) == pytest.approx(0.1, rel=0.05)  # measured by the fog, not told
    site.until(lambda: site.running["b"] and not site.running["a"])  # flagged: it leads nothing
    for _ in range(10):  # its later reports change nothing; b (honest, 200 ms) is never set aside
        site.step()
    assert sum(times()["a"]) == pytest.approx(0.1, rel=0.05)
    assert not any(e.kind in ("stage slow", "timings refuted") and e.device == "b" for e in site.events)
