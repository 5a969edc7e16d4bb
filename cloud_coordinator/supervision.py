"""When the coordinator submits, waits, or gives up: a pure state machine over what Flower reports.

A ``flwr run --stream`` process ending says nothing about the run: the log
stream can drop while the ServerApp goes on. Resubmitting then would put two
live runs on one checkpoint lineage, both writing checkpoints. So the run's
state comes from Flower (``flwr ls --run-id``): the supervisor resubmits only
after Flower says the run finished (completed without our report, failed or
stopped), or after the SuperLink itself died (its runs die with it; stale
ones are stopped before the next submit). ``Supervisor`` in ``launcher`` is
the adapter: it turns observations into ``Event``s and carries out the
``Action``s; everything here is a table, tested without processes.

The watchdog: a ServerApp at work says so every training attempt
(``progress.json``); when it has said nothing for longer than a working
round can take (``watchdog_bound``), ``diagnose`` names the component that
is down and says in one line what the coordinator waits for, and ``step``
restarts that component (``STALLED``), a bounded number of times.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

__all__ = ["ACTIVE", "Action", "Component", "Event", "Health", "Limits", "RunPhase", "State", "TABLE", "diagnose",
           "flower_event", "step", "watchdog_bound"]

ACTIVE = frozenset({"pending", "starting", "running"})  # Flower's run statuses before "finished:<why>"


class RunPhase(StrEnum):
    IDLE = "idle"            # no run of ours is live: the next action submits one
    LIVE = "live"            # Flower has our run; its log stream is followed
    CHECKING = "checking"    # the log stream ended: asking Flower whether the run did
    SETTLING = "settling"    # Flower says finished: give report.json a moment to land
    DONE = "done"
    FAILED = "failed"


class Event(StrEnum):
    START = "start"
    SUBMITTED = "submitted"            # Flower accepted the run (we have its id)
    SUBMIT_FAILED = "submit-failed"    # flwr run exited without a run id
    STREAM_ENDED = "stream-ended"
    ACTIVE = "active"                  # Flower: pending / starting / running
    FINISHED = "finished"              # Flower: finished:completed / failed / stopped
    UNKNOWN = "unknown"                # could not ask Flower
    SETTLED = "settled"                # finished, and no report came
    SUPERLINK_DEAD = "superlink-dead"
    REPORT_DONE = "report-done"
    FATAL = "fatal"                    # the ServerApp wrote fatal.json
    TIMEOUT = "timeout"
    STALLED = "stalled"                # the watchdog: no round progress within its bound


class Action(StrEnum):
    ENSURE_SUPERLINK = "ensure-superlink"
    STOP_STALE = "stop-stale"          # stop runs Flower still lists as live (their ServerApp is gone)
    SUBMIT = "submit"
    QUERY = "query"                    # ask Flower for the run's status
    FOLLOW = "follow"                  # follow the run's logs again (the stream ended, the run did not)
    STOP_RUN = "stop-run"              # ask Flower to stop our run (its ServerApp is gone or silent)
    RESTART_SUPERLINK = "restart-superlink"  # stop our SuperLink (and its SuperExec); ENSURE_SUPERLINK starts it
    FINISH = "finish"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Limits:
    max_restarts: int = 5
    quick_failures: int = 2     # consecutive runs refused or failed within seconds: retrying will not help
    max_stalls: int = 3         # watchdog restarts before giving up with its reason


@dataclass(frozen=True, slots=True)
class State:
    phase: RunPhase = RunPhase.IDLE
    run_id: int | None = None
    restarts: int = 0
    quick: int = 0
    reason: str = ""
    stalls: int = 0


_ANY = "*"
# (phase, event) -> (next phase, actions, counts as a restart). Terminal phases ignore everything.
TABLE: dict[tuple[RunPhase | str, Event], tuple[RunPhase | None, tuple[Action, ...], bool]] = {
    (RunPhase.IDLE, Event.START): (RunPhase.IDLE, (Action.ENSURE_SUPERLINK, Action.STOP_STALE, Action.SUBMIT), False),
    (RunPhase.IDLE, Event.SUBMITTED): (RunPhase.LIVE, (), False),
    (RunPhase.IDLE, Event.SUBMIT_FAILED): (RunPhase.IDLE, (Action.ENSURE_SUPERLINK, Action.SUBMIT), True),
    (RunPhase.LIVE, Event.STREAM_ENDED): (RunPhase.CHECKING, (Action.QUERY,), False),
    (RunPhase.LIVE, Event.ACTIVE): (RunPhase.LIVE, (), False),
    (RunPhase.LIVE, Event.UNKNOWN): (RunPhase.LIVE, (), False),
    (RunPhase.LIVE, Event.FINISHED): (RunPhase.SETTLING, (), False),
    (RunPhase.CHECKING, Event.ACTIVE): (RunPhase.LIVE, (Action.FOLLOW,), False),
    (RunPhase.CHECKING, Event.UNKNOWN): (RunPhase.CHECKING, (Action.QUERY,), False),
    (RunPhase.CHECKING, Event.FINISHED): (RunPhase.SETTLING, (), False),
    (RunPhase.SETTLING, Event.SETTLED): (RunPhase.IDLE, (Action.ENSURE_SUPERLINK, Action.SUBMIT), True),
    (_ANY, Event.SUPERLINK_DEAD): (RunPhase.IDLE, (Action.ENSURE_SUPERLINK, Action.STOP_STALE, Action.SUBMIT), True),
    (_ANY, Event.REPORT_DONE): (RunPhase.DONE, (Action.FINISH,), False),
    (_ANY, Event.FATAL): (RunPhase.FAILED, (Action.FAIL,), False),
    (_ANY, Event.TIMEOUT): (RunPhase.FAILED, (Action.FAIL,), False),
}


class Component(StrEnum):
    SUPERLINK = "superlink"
    SUPEREXEC = "superexec"     # the SuperLink's child that launches ServerApps: without it runs stay pending
    SERVERAPP = "serverapp"


@dataclass(frozen=True, slots=True)
class Health:
    """What the supervisor sees when the watchdog fires (None: could not tell)."""
    superlink: bool
    superexec: bool | None
    serverapp: bool | None
    run_id: int | None
    run_status: str | None      # Flower's (flwr ls)
    waiting: str = ""           # the ServerApp's last word: what its round waits for (progress.json)


def watchdog_bound(round_timeout: float, grace: float, *, slack_s: float = 60.0) -> float:
    """The longest a working ServerApp stays silent: an attempt waits up to ``round_timeout`` for nodes and
    ``round_timeout + grace`` for replies, an evaluation ``round_timeout`` more; plus start-up on a busy host."""
    return 3.0 * round_timeout + grace + slack_s


def diagnose(silent_s: float, bound_s: float, h: Health) -> tuple[Component, str]:
    """The component to restart, and one line saying what the coordinator has been waiting for."""
    if not h.superlink:
        down, why = Component.SUPERLINK, "the SuperLink is down"
    elif h.superexec is False:
        down, why = Component.SUPEREXEC, "the SuperExec is down (no ServerApp can start)"
    else:
        down = Component.SERVERAPP
        why = "no ServerApp runs" if h.serverapp is False else "the ServerApp is silent"
    run = f"run {h.run_id}" if h.run_id is not None else "no run"
    status = h.run_status or "unknown to Flower"
    waiting = h.waiting or "the ServerApp has reported no round yet"
    return down, f"no round progress for {silent_s:.0f} s (watchdog {bound_s:.0f} s): {run} {status}; {waiting}; {why}"


def _stalled(state: State, limits: Limits, component: Component | None, restartable: bool,
             reason: str) -> tuple[State, tuple[Action, ...]]:
    if state.phase not in (RunPhase.LIVE, RunPhase.CHECKING):
        return state, ()
    new = replace(state, phase=RunPhase.IDLE, run_id=None, stalls=state.stalls + 1, restarts=state.restarts + 1,
                  reason=reason)
    if component in (Component.SUPERLINK, Component.SUPEREXEC) and not restartable:
        return replace(new, phase=RunPhase.FAILED, reason=f"{reason}; the SuperLink is not ours to restart"), \
            (Action.FAIL,)
    if new.restarts > limits.max_restarts:
        return replace(new, phase=RunPhase.FAILED, reason=f"{reason}; gave up after {limits.max_restarts} restarts"), \
            (Action.FAIL,)
    if new.stalls > limits.max_stalls:
        return replace(new, phase=RunPhase.FAILED, reason=f"{reason}; gave up after {limits.max_stalls} watchdog "
                                                        "restarts"), (Action.FAIL,)
    if component is Component.SERVERAPP:
        return new, (Action.STOP_RUN, Action.ENSURE_SUPERLINK, Action.SUBMIT)
    return new, (Action.STOP_RUN, Action.RESTART_SUPERLINK, Action.ENSURE_SUPERLINK, Action.STOP_STALE,
                 Action.SUBMIT)


def flower_event(status: str | None) -> Event:
    """``flwr ls`` status text ("running", "finished:failed", ...; None: no answer) -> Event."""
    if not status:
        return Event.UNKNOWN
    head = status.split(":", 1)[0].strip().lower()
    if head in ACTIVE:
        return Event.ACTIVE
    return Event.FINISHED if head == "finished" else Event.UNKNOWN


def step(state: State, event: Event, limits: Limits = Limits(), *, run_id: int | None = None, quick: bool = False,
         reason: str = "", component: Component | None = None,
         restartable: bool = True) -> tuple[State, tuple[Action, ...]]:
    """The next state and what to do. ``quick``: the run was refused or failed within seconds of submit.

    ``STALLED`` (the watchdog): ``component`` is what ``diagnose`` found down, ``restartable`` whether the
    SuperLink is ours; the run is stopped before the next submit, so a stall never makes a second live run.
    """
    if state.phase in (RunPhase.DONE, RunPhase.FAILED):
        return state, ()
    if event is Event.STALLED:
        return _stalled(state, limits, component, restartable, reason)
    row = TABLE.get((state.phase, event)) or TABLE.get((_ANY, event))
    if row is None:  # an event that means nothing in this phase (a late stream end, a stale answer)
        return state, ()
    phase, actions, restart = row
    new = replace(state, phase=phase or state.phase, reason=reason or state.reason)
    if event is Event.SUBMITTED:
        new = replace(new, run_id=run_id)
    if event in (Event.SUBMIT_FAILED, Event.FINISHED):
        new = replace(new, quick=state.quick + 1 if quick else 0)
    if event in (Event.SETTLED, Event.SUPERLINK_DEAD, Event.SUBMIT_FAILED):
        new = replace(new, run_id=None)
    if restart:
        new = replace(new, restarts=state.restarts + 1)
        if new.quick >= limits.quick_failures:
            return replace(new, phase=RunPhase.FAILED, reason=f"flwr run keeps failing: {new.reason}"), (Action.FAIL,)
        if new.restarts > limits.max_restarts:
            return replace(new, phase=RunPhase.FAILED, reason=f"gave up after {limits.max_restarts} restarts"), \
                (Action.FAIL,)
    return new, actions
