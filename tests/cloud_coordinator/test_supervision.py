"""The supervisor's state machine (``cloud_coordinator.supervision``), without processes."""
from __future__ import annotations

import pytest

from cloud_coordinator.supervision import (
    Action,
    Component,
    Event,
    Health,
    Limits,
    RunPhase,
    State,
    diagnose,
    flower_event,
    step,
    watchdog_bound,
)

A, E, P = Action, Event, RunPhase


@pytest.mark.parametrize(("phase", "event", "kw", "want_phase", "want_actions"), [
    (P.IDLE, E.START, {}, P.IDLE, (A.ENSURE_SUPERLINK, A.STOP_STALE, A.SUBMIT)),
    (P.IDLE, E.SUBMITTED, {"run_id": 7}, P.LIVE, ()),
    (P.IDLE, E.SUBMIT_FAILED, {}, P.IDLE, (A.ENSURE_SUPERLINK, A.SUBMIT)),
    # the stream ending is not the run ending: ask Flower
    (P.LIVE, E.STREAM_ENDED, {}, P.CHECKING, (A.QUERY,)),
    (P.CHECKING, E.ACTIVE, {}, P.LIVE, (A.FOLLOW,)),
    (P.CHECKING, E.UNKNOWN, {}, P.CHECKING, (A.QUERY,)),
    (P.CHECKING, E.FINISHED, {}, P.SETTLING, ()),
    (P.LIVE, E.ACTIVE, {}, P.LIVE, ()),
    (P.LIVE, E.UNKNOWN, {}, P.LIVE, ()),
    (P.LIVE, E.FINISHED, {}, P.SETTLING, ()),
    (P.SETTLING, E.SETTLED, {}, P.IDLE, (A.ENSURE_SUPERLINK, A.SUBMIT)),
    (P.LIVE, E.SUPERLINK_DEAD, {}, P.IDLE, (A.ENSURE_SUPERLINK, A.STOP_STALE, A.SUBMIT)),
    (P.CHECKING, E.SUPERLINK_DEAD, {}, P.IDLE, (A.ENSURE_SUPERLINK, A.STOP_STALE, A.SUBMIT)),
    (P.SETTLING, E.REPORT_DONE, {}, P.DONE, (A.FINISH,)),
    (P.LIVE, E.REPORT_DONE, {}, P.DONE, (A.FINISH,)),
    (P.LIVE, E.FATAL, {"reason": "bad rule"}, P.FAILED, (A.FAIL,)),
    (P.CHECKING, E.TIMEOUT, {}, P.FAILED, (A.FAIL,)),
    # events that mean nothing here change nothing (no resubmit from a stale or late signal)
    (P.LIVE, E.SETTLED, {}, P.LIVE, ()),
    (P.LIVE, E.SUBMITTED, {"run_id": 9}, P.LIVE, ()),
    (P.CHECKING, E.STREAM_ENDED, {}, P.CHECKING, ()),
    (P.SETTLING, E.ACTIVE, {}, P.SETTLING, ()),
    (P.IDLE, E.FINISHED, {}, P.IDLE, ()),
    (P.DONE, E.SUPERLINK_DEAD, {}, P.DONE, ()),
    (P.FAILED, E.START, {}, P.FAILED, ()),
])
def test_transitions(phase: RunPhase, event: Event, kw: dict, want_phase: RunPhase,  # type: ignore[type-arg]
                     want_actions: tuple[Action, ...]) -> None:
    new, actions = step(State(phase=phase, run_id=3), event, **kw)
    assert (new.phase, actions) == (want_phase, want_actions)


def test_submit_is_reached_only_after_flower_says_finished_or_the_superlink_died() -> None:
    """Every path into SUBMIT from a live run goes through FINISHED (Flower) or SUPERLINK_DEAD."""
    for phase in (P.LIVE, P.CHECKING):
        for event in E:
            if event in (E.SUPERLINK_DEAD,):
                continue
            _, actions = step(State(phase=phase, run_id=1), event, component=Component.SERVERAPP)
            if event is E.STALLED:  # the watchdog stops the run before anything is submitted
                assert actions.index(A.STOP_RUN) < actions.index(A.SUBMIT)
                continue
            assert A.SUBMIT not in actions, (phase, event)


def test_a_stream_drop_while_flower_runs_keeps_the_one_run() -> None:
    s, _ = step(State(), E.START)
    s, _ = step(s, E.SUBMITTED, run_id=42)
    s, acts = step(s, E.STREAM_ENDED)
    s, acts = step(s, E.ACTIVE)
    assert s.phase is P.LIVE and s.run_id == 42 and acts == (A.FOLLOW,) and s.restarts == 0


def test_restarts_are_counted_and_bounded() -> None:
    s = State(phase=P.LIVE, run_id=1)
    for i in range(3):
        s, _ = step(s, E.FINISHED, Limits(max_restarts=2))
        s, acts = step(s, E.SETTLED, Limits(max_restarts=2))
        assert s.run_id is None
        if i < 2:
            assert s.phase is P.IDLE and s.restarts == i + 1
            s, _ = step(s, E.SUBMITTED, run_id=i + 2)
    assert s.phase is P.FAILED and acts == (A.FAIL,) and s.reason == "gave up after 2 restarts"


def test_quick_failures_stop_after_two_and_say_why() -> None:
    s, _ = step(State(), E.SUBMIT_FAILED, quick=True, reason="Invalid run config")
    assert s.phase is P.IDLE and s.quick == 1
    s, acts = step(s, E.SUBMIT_FAILED, quick=True, reason="Invalid run config")
    assert s.phase is P.FAILED and acts == (A.FAIL,) and s.reason == "flwr run keeps failing: Invalid run config"
    # a slow failure resets the count: a run that worked for a while is worth resubmitting
    s, _ = step(State(phase=P.LIVE, run_id=1, quick=1), E.FINISHED, quick=False)
    assert s.quick == 0


@pytest.mark.parametrize(("status", "want"), [
    ("pending", E.ACTIVE), ("starting", E.ACTIVE), ("running", E.ACTIVE),
    ("finished:completed", E.FINISHED), ("finished:failed", E.FINISHED), ("finished:stopped", E.FINISHED),
    (None, E.UNKNOWN), ("", E.UNKNOWN), ("weird", E.UNKNOWN),
])
def test_flower_status(status: str | None, want: Event) -> None:
    assert flower_event(status) is want


# -- the watchdog


def test_the_watchdog_bound_covers_a_working_round() -> None:
    b = watchdog_bound(30.0, 2.0)
    assert b >= 2 * 30.0 + 2.0 + 30.0  # nodes, replies + grace, evaluation
    assert watchdog_bound(60.0, 5.0) > b


_UP = Health(True, True, True, 7, "running", "round 2 attempt 1: waiting for replies of 3 nodes (quorum 3)")


@pytest.mark.parametrize(("health", "component", "says"), [
    (Health(False, None, None, 7, None), Component.SUPERLINK, "the SuperLink is down"),
    (Health(True, False, False, 7, "pending"), Component.SUPEREXEC, "run 7 pending; the ServerApp has reported no "
                                                                    "round yet; the SuperExec is down"),
    (Health(True, True, False, 7, "running"), Component.SERVERAPP, "no ServerApp runs"),
    (_UP, Component.SERVERAPP, "run 7 running; round 2 attempt 1: waiting for replies of 3 nodes (quorum 3); the "
                               "ServerApp is silent"),
    (Health(True, None, None, None, None), Component.SERVERAPP, "no run unknown to Flower"),
])
def test_diagnose_names_the_component_and_what_it_waits_for(health: Health, component: Component,
                                                            says: str) -> None:
    got, line = diagnose(251.4, 250.0, health)
    assert got is component and says in line and "\n" not in line
    assert line.startswith("no round progress for 251 s (watchdog 250 s)")


@pytest.mark.parametrize(("component", "want"), [
    (Component.SERVERAPP, (A.STOP_RUN, A.ENSURE_SUPERLINK, A.SUBMIT)),
    (Component.SUPEREXEC, (A.STOP_RUN, A.RESTART_SUPERLINK, A.ENSURE_SUPERLINK, A.STOP_STALE, A.SUBMIT)),
    (Component.SUPERLINK, (A.STOP_RUN, A.RESTART_SUPERLINK, A.ENSURE_SUPERLINK, A.STOP_STALE, A.SUBMIT)),
])
def test_a_stall_restarts_the_component_that_is_down(component: Component, want: tuple[Action, ...]) -> None:
    for phase in (P.LIVE, P.CHECKING):
        s, acts = step(State(phase=phase, run_id=4), E.STALLED, component=component, reason="why")
        assert (s.phase, acts, s.run_id, s.stalls, s.restarts, s.reason) == (P.IDLE, want, None, 1, 1, "why")


def test_stalls_are_bounded_and_the_last_one_says_why() -> None:
    lim = Limits(max_restarts=10, max_stalls=2)
    s = State(phase=P.LIVE, run_id=1)
    for i in range(3):
        s, acts = step(s, E.STALLED, lim, component=Component.SUPEREXEC, reason=f"stall {i}")
        if i < 2:
            assert s.phase is P.IDLE
            s, _ = step(s, E.SUBMITTED, lim, run_id=i + 2)
    assert s.phase is P.FAILED and acts == (A.FAIL,)
    assert s.reason == "stall 2; gave up after 2 watchdog restarts"


def test_a_stall_counts_against_max_restarts_too() -> None:
    s, _ = step(State(phase=P.LIVE, run_id=1, restarts=5), E.STALLED, Limits(max_restarts=5),
                   component=Component.SERVERAPP, reason="silent")
    assert s.phase is P.FAILED and s.reason == "silent; gave up after 5 restarts"


def test_a_superlink_that_is_not_ours_is_not_restarted() -> None:
    s, acts = step(State(phase=P.LIVE, run_id=1), E.STALLED, component=Component.SUPEREXEC, reason="x",
                   restartable=False)
    assert s.phase is P.FAILED and acts == (A.FAIL,) and "not ours to restart" in s.reason


@pytest.mark.parametrize("phase", [P.IDLE, P.SETTLING, P.DONE, P.FAILED])
def test_a_stall_outside_a_live_run_changes_nothing(phase: RunPhase) -> None:
    s0 = State(phase=phase)
    assert step(s0, E.STALLED, component=Component.SERVERAPP) == (s0, ())
