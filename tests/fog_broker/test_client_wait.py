"""``FogClient.wait_running``: a status call that times out on a busy fog is "not yet"."""
from __future__ import annotations

from typing import Any

import pytest

import fog_broker.client as client_module
from fog_broker.client import FogClient


class Clock:
    """The client's ``time`` on a virtual clock: a unit test never sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        self.now += secs


class Scripted(FogClient):
    """A client whose status answers come from a script (no broker); an exception answer is
    raised after the call's whole timeout, as a fog that does not answer in time."""

    def __init__(self, clock: Clock, answers: list[Any]) -> None:  # nothing to connect to
        self.clock = clock
        self.answers = answers
        self.calls: list[float] = []

    def status(self, timeout: float = 10.0, *, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        self.calls.append(timeout)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            self.clock.now += timeout
            raise answer
        return answer  # type: ignore[no-any-return]


RUNNING = {"workloads": [{"name": "w", "replicas": 1, "healthy_replicas": 1}]}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(client_module, "time", c)
    return c


def test_a_timed_out_status_call_is_not_yet_and_the_wait_goes_on(clock: Clock) -> None:
    c = Scripted(clock, [TimeoutError("control status: no answer in 10 s"), RUNNING])
    assert c.wait_running("w", 30)["healthy_replicas"] == 1
    assert c.calls == [10.0, 10.0] and clock.now == 10.0


def test_the_wait_as_a_whole_is_still_bounded(clock: Clock) -> None:
    c = Scripted(clock, [TimeoutError("no answer")])
    with pytest.raises(TimeoutError, match="workload w not running after 25 s"):
        c.wait_running("w", 25)
    assert c.calls == [10.0, 10.0, 5.0] and clock.now == 25.0  # no call outlives the wait


def test_other_errors_are_not_swallowed(clock: Clock) -> None:
    c = Scripted(clock, [ConnectionRefusedError("fog down")])
    with pytest.raises(ConnectionRefusedError):
        c.wait_running("w", 30)
