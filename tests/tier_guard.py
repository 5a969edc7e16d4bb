"""The tier check: a test without a tier marker is a unit test, and a unit test starts no process,
opens no socket and never sleeps.

conftest.py wraps each unmarked test's setup, call and teardown in :func:`guard`. While it is
active, the doors to the outside world are patched: starting a process (``subprocess.Popen``,
``os.fork``, ``os.posix_spawn``, ``multiprocessing``), a socket's ``connect``/``bind`` and
``time.sleep`` with a positive delay. Passing through one records what the test did and raises
:class:`TierViolation` with one line naming it and the marker to add. The record also fails the
test when the code under test swallowed the exception (or a thread of its own hit the door).

``slow`` is the old name of ``e2e`` and still counts as it (tests on other branches use it).
"""
from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

TIERS = ("integration", "e2e", "slow")  # unmarked: unit
HINT = "mark it pytest.mark.integration (whole-system giants: pytest.mark.e2e)"


class TierViolation(AssertionError):
    """An unmarked (unit) test reached a process, a socket or a sleep."""


def tier_of(item: pytest.Item) -> str:
    """``unit``, ``integration`` or ``e2e`` from the item's markers (``slow`` and ``nightly`` count
    as ``e2e``)."""
    names = {m.name for m in item.iter_markers()}
    if names & {"e2e", "slow", "nightly"}:
        return "e2e"
    return "integration" if "integration" in names else "unit"


@contextmanager
def guard(nodeid: str) -> Iterator[list[str]]:
    """Patch the doors for one phase of a unit test; yield the list of what it did."""
    did: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def door(owner: object, name: str, what: str,
             allow: Callable[..., bool] = lambda *a, **k: False) -> None:
        real = getattr(owner, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            if allow(*args, **kwargs):
                return real(*args, **kwargs)
            message = f"{nodeid} {what} but has no tier marker: {HINT}"
            did.append(message)
            raise TierViolation(message)

        saved.append((owner, name, real))
        setattr(owner, name, patched)

    door(subprocess.Popen, "_execute_child", "started a process (subprocess)")
    door(os, "fork", "forked a process (os.fork)")
    door(os, "posix_spawn", "started a process (os.posix_spawn)")
    door(os, "posix_spawnp", "started a process (os.posix_spawnp)")
    door(multiprocessing.process.BaseProcess, "start", "started a process (multiprocessing)")
    door(socket.socket, "connect", "connected a socket")
    door(socket.socket, "connect_ex", "connected a socket")
    door(socket.socket, "bind", "bound a socket")
    door(time, "sleep", "slept (time.sleep)", allow=lambda secs=0, *a, **k: secs <= 0)
    try:
        yield did
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


def check(item: pytest.Item, did: list[str]) -> None:
    """Fail the phase when the test did something its tier forbids (even if the error was caught)."""
    if did:
        raise TierViolation(did[0])
