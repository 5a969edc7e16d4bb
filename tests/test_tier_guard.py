"""The tier check must catch what it promises: a unit test that starts a process, opens a socket
or sleeps fails with one line naming what it did and the marker to add."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from tier_guard import TierViolation, guard


@pytest.mark.parametrize("door", ["subprocess", "fork", "bind", "connect", "sleep"])
def test_each_door_is_refused_and_named(door: str) -> None:
    refused = pytest.raises(TierViolation, match=r"^tests/x.py::t .* no tier marker: mark it "
                                                 r"pytest.mark.integration")
    with guard("tests/x.py::t") as did, refused:
        if door == "subprocess":
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        elif door == "fork":
            os.fork()
        elif door == "sleep":
            time.sleep(0.01)
        else:
            with socket.socket() as s:
                if door == "bind":
                    s.bind(("127.0.0.1", 0))
                else:
                    s.connect(("127.0.0.1", 9))
    assert len(did) == 1  # recorded even if the code under test had swallowed the error


def test_a_zero_sleep_is_no_sleep_and_the_doors_close_behind() -> None:
    real = time.sleep
    with guard("t") as did:
        time.sleep(0)
    assert did == [] and time.sleep is real
