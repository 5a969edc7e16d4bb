"""Issue 21: queue-aware uplink samples, and the data lane that keeps STATE adverts from queueing.

The estimator tests use synthetic ack timings on one FIFO connection; the lane tests use real
threads with bounded waits (the ack watcher, its give-up, a blocked executor thread).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from edge_agent import acks
from edge_agent.acks import AckWatcher
from edge_agent.lane import LANE_MIN_BYTES, DataLane, lane_budget
from edge_agent.stats import LinkEstimator

RTT = 0.005
FRAME = 400_000   # bytes: 0.32 s at 10 Mbit/s
STATE = 600       # a STATE advert


def _fifo(sends: list[tuple[float, int]], bps: float, rtt: float = RTT) -> list[float]:
    """Ack times of publishes ``(sent_at, nbytes)`` on one FIFO link of ``bps`` and ``rtt``."""
    acks_at, wire_free = [], 0.0
    for sent, nbytes in sends:
        start = max(sent, wire_free)
        wire_free = start + 8 * nbytes / bps
        acks_at.append(wire_free + rtt)
    return acks_at


def _estimates(sends: list[tuple[float, int]], acked: list[float]) -> tuple[float, float]:
    """(new rule, old rule) uplink estimates for the same completions."""
    new, old = LinkEstimator(), LinkEstimator()
    for _ in range(8):  # an idle link first: small acks give the RTT, as after a connect
        new.observe(STATE, RTT)
        old.observe(STATE, RTT)
    for (sent, nbytes), ack in zip(sends, acked):
        new.complete(nbytes, sent, ack)
        old.observe(nbytes, ack - sent)
    assert new.uplink_bps is not None and old.uplink_bps is not None
    return new.uplink_bps, old.uplink_bps


def test_a_full_pipeline_is_measured_at_the_link_rate_not_half_of_it() -> None:
    """Two frames in flight (the executor produces as fast as the link drains), with a STATE
    advert queued behind them every few seconds: the old rule reads each frame's wait behind the
    one before as transfer time (about half the rate, as seen on the 10 Mbit/s link)."""
    bps = 10e6
    sends: list[tuple[float, int]] = []
    frame_acks: list[float] = []
    for k in range(40):
        sent = 0.0 if k < 2 else frame_acks[k - 2]  # produced when frame k-2 is acked
        sends.append((sent, FRAME))
        if k % 10 == 0:
            sends.append((sent + 0.001, STATE))
        acked = _fifo(sends, bps)
        frame_acks = [a for (_, n), a in zip(sends, acked) if n == FRAME]
    new, old = _estimates(sends, _fifo(sends, bps))
    assert new == pytest.approx(bps, rel=0.03), f"new {new / 1e6:.2f} Mbit/s; old rule {old / 1e6:.2f}"
    assert old < 0.7 * bps, f"baseline: the old rule reads {old / 1e6:.2f} Mbit/s of {bps / 1e6:.0f}"


def test_a_growing_backlog_does_not_drag_the_estimate_down() -> None:
    """Frames published faster than the link carries (a backlog of seconds): back to back."""
    bps = 4e6
    sends = [(0.1 * k, FRAME) for k in range(30)]
    new, old = _estimates(sends, _fifo(sends, bps))
    assert new == pytest.approx(bps, rel=0.03), f"new {new / 1e6:.2f}; old rule {old / 1e6:.2f}"
    assert old < 0.5 * bps, f"baseline: the old rule reads {old / 1e6:.2f} Mbit/s of 4"


def test_unqueued_publishes_are_measured_as_before() -> None:
    """An idle link between frames: ``complete`` gives exactly what ``observe`` gives."""
    bps = 20e6
    sends = [(1.0 * k, FRAME) for k in range(10)]
    new, old = _estimates(sends, _fifo(sends, bps))
    assert new == pytest.approx(old) and new == pytest.approx(bps, rel=0.03)


def test_a_small_queued_publish_gives_no_rtt_sample() -> None:
    est = LinkEstimator()
    est.complete(STATE, 0.0, RTT)
    est.complete(FRAME, 1.0, 1.0 + RTT + 8 * FRAME / 10e6)
    est.complete(STATE, 1.01, 1.0 + 2 * RTT + 8 * FRAME / 10e6)  # waited behind the frame
    assert est.rtt_s == pytest.approx(RTT)
    est.complete(STATE, 5.0, 5.0 + 2 * RTT)  # unqueued: an RTT sample again
    assert est.rtt_s is not None and est.rtt_s > RTT * 0.99


# ---------------------------------------------------------------- the ack watcher


@dataclass
class _Handle:
    done: bool = False

    def is_published(self) -> bool:
        return self.done


class _Recorder(LinkEstimator):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, float, float]] = []

    def complete(self, nbytes: int, sent_at: float, acked_at: float) -> None:
        self.calls.append((nbytes, sent_at, acked_at))
        super().complete(nbytes, sent_at, acked_at)


@pytest.mark.integration
def test_the_watcher_hands_completions_in_send_order_with_their_ack_times() -> None:
    w, est = AckWatcher(), _Recorder()
    handles = [_Handle() for _ in range(3)]
    finished = threading.Event()
    results: list[bool] = []

    def done(acked: bool) -> None:
        results.append(acked)
        if len(results) == 3:
            finished.set()

    for i, h in enumerate(handles):
        w.track(h, 100_000 + i, float(i), est, done)
    for h in reversed(handles):  # however the polls see them, the estimator sees send order
        h.done = True
    assert finished.wait(5), "no completions"
    assert [c[0] for c in est.calls] == [100_000, 100_001, 100_002]
    assert all(c[2] >= c[1] for c in est.calls) and results == [True, True, True]


# ---------------------------------------------------------------- the data lane


def _blocked_acquire(lane: DataLane, nbytes: int) -> tuple[threading.Thread, threading.Event]:
    got = threading.Event()

    def run() -> None:
        lane.acquire(nbytes)
        got.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_lane_budget_follows_the_uplink_with_a_floor() -> None:
    assert lane_budget(None) == LANE_MIN_BYTES == lane_budget(0.0) == lane_budget(1e6)
    assert lane_budget(100e6) == int(0.5 * 100e6 / 8)


def test_data_waits_for_room_in_the_budget_and_goes_when_an_ack_frees_it() -> None:
    lane = DataLane(lambda: 1000, small_bytes=0, max_wait_s=30)
    first = lane.acquire(600)
    lane.acquire(600)  # 600 in flight < 1000: goes (one frame over the mark, not under it)
    assert lane.waits == 0 and lane.in_flight == 1200
    t, got = _blocked_acquire(lane, 200)
    assert not got.wait(0.2), "a publish over the budget went at once"
    lane.release(first)
    assert got.wait(5), "the ack did not let the waiting publish go"
    t.join(5)
    assert lane.waits == 1 and lane.timeouts == 0 and lane.in_flight == 800


def test_one_frame_always_goes_when_nothing_is_in_flight() -> None:
    lane = DataLane(lambda: 1000, small_bytes=0, max_wait_s=30)
    big = lane.acquire(50_000)  # larger than the whole budget
    assert lane.waits == 0 and lane.in_flight == 50_000
    t, got = _blocked_acquire(lane, 10)
    assert not got.wait(0.2)
    lane.release(big)
    assert got.wait(5)
    t.join(5)


def test_small_publishes_never_wait() -> None:
    lane = DataLane(lambda: 1000, max_wait_s=30)
    lane.acquire(50_000)
    lane.acquire(lane.small_bytes)  # an error reply from the MQTT worker thread: no wait
    assert lane.waits == 0


def test_the_wait_is_bounded_then_the_publish_goes_and_is_counted() -> None:
    lane = DataLane(lambda: 1000, small_bytes=0, max_wait_s=0.05)
    lane.acquire(1000)
    lane.acquire(900)  # nothing ever acks: goes after 50 ms
    assert lane.waits == 1 and lane.timeouts == 1 and lane.in_flight == 1900
    assert lane.status()["timeouts"] == 1 and lane.status()["wait_s"] >= 0.05


@pytest.mark.integration
def test_a_publish_the_watcher_gives_up_on_releases_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acks, "_GIVE_UP_S", 0.05)
    lane, w = DataLane(lambda: 1000, small_bytes=0, max_wait_s=30), AckWatcher()
    ticket = lane.acquire(1000)
    w.track(_Handle(), 1000, 0.0, LinkEstimator(),  # sent "long ago" on a dead connection
            lambda acked: lane.release(ticket, given_up=not acked))
    t, got = _blocked_acquire(lane, 900)
    assert got.wait(5), "the give-up did not release the lane"
    t.join(5)
    assert lane.given_up == 1 and lane.in_flight == 900


def test_a_reconnect_forgets_the_old_connections_bytes() -> None:
    lane = DataLane(lambda: 1000, small_bytes=0, max_wait_s=30)
    old = lane.acquire(1000)
    t, got = _blocked_acquire(lane, 900)
    lane.reset()  # the MQTT client reconnected
    assert got.wait(5), "a reconnect left the lane stuck"
    t.join(5)
    lane.release(old)  # a late ack of the old connection does not free the new one's bytes
    assert lane.in_flight == 900 and lane.resets == 1


def test_closing_the_lane_frees_a_waiting_executor() -> None:
    lane = DataLane(lambda: 1000, small_bytes=0, max_wait_s=30)
    lane.acquire(1000)
    t, got = _blocked_acquire(lane, 900)
    lane.close()
    assert got.wait(5)
    t.join(5)
