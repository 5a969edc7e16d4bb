"""Reported timings against the router's round trips (fog_broker.claim_check, pure)."""
from __future__ import annotations

import itertools

import pytest

from fog_broker.claim_check import ClaimCheck, ClaimCheckConfig
from runtime.errors import LocalViolation

CFG = ClaimCheckConfig(factor=4.0, slack_s=0.02, samples=5, peer_factor=4.0, alone_s=0.04, span_s=3.0)
CLOCK = itertools.count(0.0, 1.0)  # an answer a second


def _feed(cc: ClaimCheck, dev: str, replica: int, seconds: float, claimed: float, n: int = 5,
          devices: tuple[str, ...] | None = None) -> list[object]:
    route = devices or (dev, dev)
    return [v for _ in range(n)
            if (v := cc.observe("w", 1, replica, route, seconds, [claimed / 2] * 2, next(CLOCK)))]


def test_a_device_claiming_50us_for_a_50ms_stage_is_refuted_once() -> None:
    cc = ClaimCheck(CFG)
    assert _feed(cc, "liar", 0, 0.050, 0.00005, n=4) == []        # fewer answers than samples: no verdict
    got = _feed(cc, "liar", 0, 0.050, 0.00005, n=3)
    assert len(got) == 1 and cc.is_refuted("liar")
    v = cc.refuted["liar"]
    assert v.observed_s == pytest.approx(0.050) and v.claimed_s == pytest.approx(0.00005)
    assert "not trusted" in v.reason and "liar" not in v.reason  # the reason names figures; the event names it


@pytest.mark.parametrize("seconds, claimed", [
    (0.012, 0.010),    # honest: a round trip a little above the compute
    (0.015, 0.0002),   # a tiny stage: network and codec dominate, but within the slack
    (0.100, 0.030),    # under 4x the claim
])
def test_honest_devices_are_not_refuted(seconds: float, claimed: float) -> None:
    cc = ClaimCheck(CFG)
    assert _feed(cc, "d", 0, seconds, claimed, n=20) == [] and not cc.is_refuted("d")


def test_the_fastest_round_trip_is_the_yardstick() -> None:
    cc = ClaimCheck(CFG)
    for s in (0.5, 0.4, 0.6, 0.003, 0.7):  # one fast answer: the device can be that fast
        assert cc.observe("w", 1, 0, ("d",), s, [0.002], next(CLOCK)) is None
    assert not cc.is_refuted("d")


def test_a_busy_host_slows_every_chain_alike_and_refutes_no_one() -> None:
    cc = ClaimCheck(ClaimCheckConfig(factor=4.0, slack_s=0.02, samples=5))  # alone: 0.5 s
    for r, dev in enumerate(("a", "b", "c")):
        assert _feed(cc, dev, r, 0.300, 0.001, devices=(dev,)) == []
    assert not cc.refuted  # the first had no peers: 300 ms beyond its claim is under alone_s
    cc2 = ClaimCheck(CFG)
    for r, dev in enumerate(("a", "b")):  # peers measured first: 60 ms beyond their claims
        _feed(cc2, dev, r, 0.061, 0.001, devices=(dev,))
    cc2.refuted.clear()
    assert _feed(cc2, "c", 2, 0.080, 0.001, devices=("c",)) == []  # as slow as its peers: the host
    assert _feed(cc2, "d", 3, 0.400, 0.001, devices=("d",)) != []  # far slower than its peers: a lie


def test_a_chain_over_several_devices_is_never_blamed_on_one() -> None:
    cc = ClaimCheck(CFG)
    assert _feed(cc, "x", 0, 0.5, 0.0001, n=20, devices=("honest", "liar")) == []
    assert not cc.refuted


def test_forgetting() -> None:
    cc = ClaimCheck(CFG)
    _feed(cc, "liar", 0, 0.050, 0.00005)
    cc.forget("liar")
    assert not cc.is_refuted("liar")
    cc.forget_workload("w")
    assert _feed(cc, "liar", 0, 0.050, 0.00005, n=4) == []  # its window started again
    assert cc.observe("w", 1, 0, ("liar",), 0.05, None, next(CLOCK)) is None  # claims unknown: nothing to check


def test_a_passing_stall_refutes_no_one() -> None:
    """20 slow answers within a few seconds (a flood at the fog, a loaded host): shorter than span_s."""
    cc = ClaimCheck(ClaimCheckConfig(factor=4.0, slack_s=0.02, samples=5, alone_s=0.04, span_s=30.0))
    t0 = next(CLOCK)
    got = [cc.observe("w", 1, 0, ("d",), 0.9, [0.001], t0 + 0.25 * i) for i in range(24)]  # 6 s: one period
    assert not any(got) and not cc.refuted
    got = [cc.observe("w", 1, 0, ("d",), 0.9, [0.001], t0 + 0.25 * i) for i in range(24, 200)]  # 50 s in all
    assert sum(1 for v in got if v) == 1 and cc.is_refuted("d")  # it lasted the whole span: a lie


@pytest.mark.parametrize("kw", [{"factor": 1.0}, {"samples": 0}, {"slack_s": -1.0}, {"peer_factor": 0.5},
                                {"span_s": -1.0},
                                {"alone_s": 0.01},
                                {"factor": float("nan")}])
def test_bad_config_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(LocalViolation):
        ClaimCheckConfig(**kw)  # type: ignore[arg-type]
