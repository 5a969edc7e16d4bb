"""Site autonomy on the coordinator side (no network): a cut link pauses a rollout instead of failing it.

``RolloutClock`` keeps the book's time still while the awaited site is cut off (bounded per
outage); ``SiteLink`` reports a cut in one line and sends nothing into a dead connection; the
service runs a held-out batch the cut interrupted again once the site answers.
"""
from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import pytest
from test_sites_config import creds_dir

from cloud_coordinator.rollout import (
    Lost,
    NewRelease,
    Probe,
    Publish,
    Rollout,
    RolloutBook,
    RolloutClock,
    RolloutPolicy,
    Seen,
    SiteStep,
    SiteView,
    Step,
)
from cloud_coordinator.sitelink import ProbeCut, SiteLink
from cloud_coordinator.sites import SiteSpec, resolve
from cloud_coordinator.siteservice import SiteService
from edge_agent.testing import FogSigner
from runtime.security import Identity

from waiting import wait_for


def test_clock_stands_still_while_cut_and_runs_on_after() -> None:
    c = RolloutClock(grace_s=100.0)
    assert c.now(10.0, False) == 10.0
    assert c.now(20.0, True) == 20.0      # the cut begins
    assert c.now(50.0, True) == 20.0      # ... and time stands still
    assert c.now(60.0, False) == 20.0     # continuous when it ends
    assert c.now(70.0, False) == 30.0     # and runs on from there
    assert c.now(80.0, True) == 40.0 and c.now(85.0, False) == 40.0   # a second outage, left out too


def test_clock_leaves_out_at_most_the_grace_per_outage() -> None:
    c = RolloutClock(grace_s=30.0)
    assert c.now(0.0, True) == 0.0
    assert c.now(30.0, True) == 0.0
    assert c.now(45.0, True) == 15.0      # past the grace the waits run again: a site cut off for good times out
    assert c.now(50.0, False) == 20.0
    before = -1.0
    for t in range(50, 200):              # never goes back, whatever the cuts
        now = c.now(float(t), (t // 7) % 2 == 0)
        assert now >= before
        before = now


def _drive(book: RolloutBook, clock: RolloutClock | None, cut: tuple[float, float], end: float) -> list[Any]:
    """Tick ``book`` each second from 0 to ``end``; the canary is cut off during ``cut``, answers otherwise."""
    out: list[Any] = book.handle(NewRelease("m", 1, "ab" * 32, "m-v000000001.release"), 0.0)
    t = 0.0
    while t < end:
        t += 1.0
        is_cut = cut[0] <= t < cut[1]
        now = clock.now(t, is_cut) if clock is not None else t
        if is_cut:
            out += book.handle(Lost("a", "cut off: no MQTT connection"), now)
        else:
            rel = {"m": (1, "file:" + "ab" * 32)} if any(isinstance(c, Publish) for c in out) else {}
            out += book.handle(Seen("a", SiteView(rel)), now)
        out += book.tick(now)
    return out


def test_a_cut_longer_than_the_timeouts_delays_a_release_it_does_not_fail_it() -> None:
    # (a first release nothing serves: unchecked at the canary, by this explicit setting)
    policy = RolloutPolicy(baseline_timeout_s=30.0, accept_timeout_s=30.0, allow_unchecked_canary=True)
    # without the clock (as before): the canary is cut off from the start for 100 s: failed, never released
    book = RolloutBook(["a"], "a", policy)
    _drive(book, None, (0.0, 100.0), 120.0)
    assert book.rollouts[0].step is Step.FAILED and "did not answer within 30 s" in book.rollouts[0].reason
    # with it: the rollout waits the cut out, publishes once the site is back, and is done
    book = RolloutBook(["a"], "a", policy)
    out = _drive(book, RolloutClock(3600.0), (0.0, 100.0), 120.0)
    assert book.rollouts[0].step is Step.DONE, book.rollouts[0].reason
    assert [c for c in out if isinstance(c, Publish)] == [Publish("a", "m", 1)]
    # still bounded: a cut longer than the grace fails it as before
    book = RolloutBook(["a"], "a", policy)
    _drive(book, RolloutClock(20.0), (0.0, 1000.0), 1000.0)
    assert book.rollouts[0].step is Step.FAILED


# ------------------------------------------------------------------ the link and the service


class _Stub:
    """The parts of a ``SiteClient`` a poll uses."""

    def __init__(self, connected: bool) -> None:
        self.connected = connected
        self.link_error = "" if connected else "cannot connect: TimeoutError: timed out"
        self.status_calls = 0

    def status(self, timeout: float, limit: int | None = None) -> dict[str, Any]:
        self.status_calls += 1
        if not self.connected:
            raise AssertionError("a status request sent into a dead connection")
        return {"releases": {}, "workloads": [], "metrics": {}}


def _cut_since(link: SiteLink) -> float | None:
    return link.cut_since


@pytest.fixture
def table(tmp_path: Path) -> Any:
    d = creds_dir(tmp_path, "a", FogSigner("fog-a", "store-a"), mqtt="127.0.0.1:18830")
    return resolve([SiteSpec("a", str(d))])


def test_link_reports_a_cut_in_one_line_and_sends_nothing_into_it(table: Any, tmp_path: Path) -> None:
    events: queue.Queue[Any] = queue.Queue()
    link = SiteLink(table.sites[0], tmp_path / "summaries", events)
    link.client = _Stub(False)  # type: ignore[assignment]
    link._poll()   # never answered yet: unreachable, but not a cut (wrong key, site never up: timeouts apply)
    assert _cut_since(link) is None and isinstance(events.get_nowait(), Lost)
    link.client = _Stub(True)  # type: ignore[assignment]
    link._poll()
    assert link.info["reachable"] and isinstance(events.get_nowait(), Seen)
    dead = _Stub(False)
    link.client = dead  # type: ignore[assignment]
    link._poll()
    lost = events.get_nowait()
    assert dead.status_calls == 0 and _cut_since(link) is not None and not link.info["reachable"]
    assert lost.error.startswith("cut off: no MQTT connection to 127.0.0.1:18830 (cannot connect: TimeoutError")
    assert "the site runs on its own" in lost.error and "\n" not in lost.error
    link.client = _Stub(True)  # type: ignore[assignment]
    link._poll()
    assert _cut_since(link) is None and link.info["reachable"] and link.info["error"] is None


@pytest.mark.integration
def test_service_pauses_for_the_awaited_site_and_reruns_a_cut_probe(table: Any, tmp_path: Path) -> None:
    svc = SiteService(tmp_path / "ck", table, Identity.generate("coordinator"))   # links built, never started
    r = Rollout("m", 2, "cd" * 32, "m-v000000002.release", Step.PROBE, canary="a", order=[],
                sites={"a": SiteStep("accepted")}, baseline={"version": 1, "followers": {"w": 1}})
    svc.book.rollouts.append(r)
    link = svc.links["a"]
    link.cut_since = time.monotonic()
    t0 = svc._now()
    time.sleep(0.05)
    assert svc._now() == t0                          # the canary is cut off: the book's time stands still
    link.cut_since = None
    assert svc._event(ProbeCut("a", "m", 2)) == []   # a cut batch is no verdict ...
    assert r.step is Step.PROBE
    out = svc._event(Seen("a", SiteView()))          # ... it runs again once the canary answers
    assert Probe("a", "m", 2, ("w",)) in out
    assert not any(isinstance(c, Probe) for c in svc._event(Seen("a", SiteView())))   # once
    assert svc._event(ProbeCut("a", "m", 1)) == [] and not svc._cut_probes           # another rollout's: ignored


@pytest.mark.integration
def test_a_failing_command_or_poll_does_not_kill_the_link_thread(table: Any, tmp_path: Path) -> None:
    events: queue.Queue[Any] = queue.Queue()
    link = SiteLink(table.sites[0], tmp_path / "summaries", events)
    done: list[str] = []

    def do(cmd: Any) -> None:
        if cmd == "boom":
            raise RuntimeError("Message publish failed: The client is not currently connected")
        done.append(cmd)

    link._do = do  # type: ignore[method-assign]
    link._connect = lambda: False  # type: ignore[method-assign]  # the site stays away
    link.start()
    try:
        link.commands.put("boom")
        link.commands.put("after")
        wait_for(lambda: done, 10, "the command after the failing one")
        assert done == ["after"] and link._thread.is_alive()
    finally:
        link.stop()
