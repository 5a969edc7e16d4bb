"""``waiting.wait_for``: returns the first truthy value, or fails at the deadline saying what."""
from __future__ import annotations

import itertools
import time

import pytest

from waiting import wait_for

pytestmark = pytest.mark.integration


def test_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    got = wait_for(lambda: next(counter) >= 3 and "ready", 5, "three calls", interval=0.001)
    assert got == "ready"


def test_times_out_naming_what_with_the_last_value_and_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"after 0.2 s waiting for the answer; last value 0$"):
        wait_for(lambda: 0, 0.2, "the answer", interval=0.05)
    assert 0.2 <= time.monotonic() - t0 < 2.0

    def flaky() -> int:
        raise ConnectionRefusedError("not yet")
    with pytest.raises(AssertionError, match=r"last error ConnectionRefusedError\('not yet'\)"):
        wait_for(flaky, 0.1, "a server", retry_on=OSError)


def test_description_can_be_computed_at_failure_or_taken_from_the_source() -> None:
    with pytest.raises(AssertionError, match="status: down"):
        wait_for(lambda: None, 0.05, lambda: "status: down")
    with pytest.raises(AssertionError, match=r"lambda: 1 > 2"):
        wait_for(lambda: 1 > 2, 0.05)


def test_a_call_that_timed_out_is_not_yet_by_default() -> None:
    """A status call to a fog busy past its own 10 s is "not yet": the wait's timeout bounds it."""
    calls = iter([TimeoutError("no answer from the fog broker within 10 s"), True])

    def cond() -> bool:
        v = next(calls)
        if isinstance(v, BaseException):
            raise v
        return v
    assert wait_for(cond, 5, "a busy fog", interval=0) is True


def test_other_errors_propagate_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(KeyError):
        wait_for(lambda: dict[str, int]()["x"], 30, "a key")
    assert time.monotonic() - t0 < 1.0


def test_checks_once_more_at_the_deadline() -> None:
    """A condition that turns true while the helper sleeps past the deadline still counts."""
    t_true = time.monotonic() + 0.15
    assert wait_for(lambda: time.monotonic() >= t_true, 0.15, "late", interval=10)
