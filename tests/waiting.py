"""The one poll-until helper of the tests: a condition, a deadline, and what we waited for.

Import it as ``from waiting import wait_for``: ``tests/`` is on ``sys.path`` because pytest puts
the directory of ``tests/conftest.py`` there (the rootdir-relative "prepend" import mode, as for
``_chaos_harness`` and the other helpers), whether it runs as ``python -m pytest`` or ``pytest``.
Wait on events (a ``threading.Event``, a queue) where the code offers one; poll with this where it
does not (another process's status, a file, a counter).
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for"]

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float, what: str | Callable[[], object] | None = None,
             *, interval: float = 0.05,
             retry_on: type[BaseException] | tuple[type[BaseException], ...] = (TimeoutError,)) -> T:
    """Call ``cond`` every ``interval`` s until it returns something truthy, and return that.

    After ``timeout`` s raise ``AssertionError`` naming ``what`` (a string, or a callable asked
    only then, for diagnostics such as a status document), the last value and the last error.
    Exceptions of ``retry_on`` count as "not yet" (a process still starting answers with errors;
    by default a ``TimeoutError``: one call to a busy fog that outlived its own timeout is "not yet",
    and this wait's ``timeout`` still bounds the whole); any other exception propagates at once.
    ``cond`` is tried at least once, and once more at the deadline, so a slow machine never fails a
    condition that holds when time is up.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        past = time.monotonic() >= deadline
        try:
            value = cond()
        except retry_on as exc:
            error = exc
        else:
            if value:
                return value
            last = value
        if past:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{_describe(what, cond)}; last value {last!r}"
                                 + (f", last error {error!r}" if error else ""))
        time.sleep(max(0.0, min(interval, deadline - time.monotonic())))


def _describe(what: str | Callable[[], object] | None, cond: Callable[[], object]) -> str:
    if callable(what):
        try:
            return str(what())
        except Exception as exc:  # noqa: BLE001 - a failing description must not hide the timeout
            return f"<description failed: {exc!r}>"
    if what is not None:
        return what
    try:  # no description given: the condition's own source line says what it was
        return inspect.getsource(cond).strip()
    except (OSError, TypeError):
        return repr(cond)
