"""A child started through ``runtime.children`` does not outlive its parent, kill -9 included."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import children

PARENT = r"""
import sys, time
from runtime import children
p = children.spawn(["sleep", "600"], user=sys.argv[1] or None)
print(p.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie is reaped by init soon after; /proc shows it as 'Z' meanwhile
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
@pytest.mark.parametrize("user", ["", "nobody"])
def test_child_dies_with_a_killed_parent(user: str) -> None:
    if user and os.geteuid() != 0:
        pytest.skip("switching user needs root")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, user], stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[2])
    assert parent.stdout is not None
    line = parent.stdout.readline()
    child = int(line)
    try:
        assert not _gone(child, 0.2), "the child should run while its parent does"
        if user:
            assert Path(f"/proc/{child}").stat().st_uid != 0
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(child, 10), "the child outlived its parent's kill -9"
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_stop_escalates_to_kill() -> None:
    p = children.spawn([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                        "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    assert children.stop(p, timeout_s=0.3) == -signal.SIGKILL
    assert not children.alive(p)


def test_a_child_started_from_a_short_lived_thread_outlives_that_thread() -> None:
    """PR_SET_PDEATHSIG follows the forking thread: the spawner thread must fork for workers."""
    import threading

    box: list[subprocess.Popen[bytes]] = []
    t = threading.Thread(target=lambda: box.append(children.spawn(["sleep", "600"])))
    t.start()
    t.join()
    p = box[0]
    try:
        assert not _gone(p.pid, 0.5), "the child died with the thread that asked for it"
    finally:
        children.stop(p, 1.0)
