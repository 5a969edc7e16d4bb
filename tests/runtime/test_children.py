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

pytestmark = pytest.mark.integration

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


# A child that starts a grandchild in a session of its own (as Flower's SuperNode starts a
# ClientApp), prints the grandchild's pid, and then either waits or exits at once.
TREE = r"""
import subprocess, sys, time
g = subprocess.Popen(["sleep", "600"], start_new_session=True)
print(g.pid, flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
sys.exit(5)
"""
TREE_PARENT = r"""
import sys
from runtime import children
p = children.spawn([sys.executable, "-c", sys.argv[1], "wait"], whole_tree=True)
time = __import__("time")
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux only")
def test_a_whole_tree_dies_with_a_killed_parent() -> None:
    """kill -9 of the parent: the guard sees it and takes the grandchild too (no orphan ClientApp)."""
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", TREE_PARENT, TREE], cwd=root, stdout=subprocess.PIPE)
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())  # the guard's command inherits the parent's stdout
    try:
        assert not _gone(grandchild, 0.2), "the grandchild should run while the tree's root does"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(grandchild, 15), "the grandchild outlived the tree's root (kill -9)"
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux only")
def test_the_guard_ends_what_its_command_left_behind_and_keeps_its_exit_code() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(children.guarded([sys.executable, "-c", TREE, "exit"]), cwd=root, capture_output=True,
                          timeout=60)
    assert done.returncode == 5, done.stderr
    assert _gone(int(done.stdout), 5), "the command's own child outlived it"


def test_stop_all_terminates_together_and_kills_what_ignores_it() -> None:
    stubborn = children.spawn([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == b"ready"
    polite = children.spawn(["sleep", "600"])
    t0 = time.monotonic()
    children.stop_all([polite, None, stubborn], timeout_s=0.5)
    assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10, "one shared deadline, not one per child"


#: A command that leaves behind a process forking a sleeper every 2 ms (400 at most): the tree
#: keeps growing while the guard kills it.
FORKER = ("import os, subprocess, sys, time\n"
          "if sys.argv[1] == 'fork':\n"
          "    for _ in range(400):\n"
          "        if os.fork() == 0:\n"
          "            time.sleep(60)\n"
          "            os._exit(0)\n"
          "        time.sleep(0.002)\n"
          "    time.sleep(60)\n"
          "else:\n"
          "    subprocess.Popen([sys.executable, '-c', sys.argv[2], 'fork', sys.argv[3]])\n"
          "    time.sleep(0.3)\n")


def _marked(marker: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and marker.encode() in Path(f"/proc/{d}/cmdline").read_bytes() \
                    and Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(d))
        except OSError:
            continue
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux only")
def test_the_guard_kills_a_tree_that_keeps_forking_until_none_is_left() -> None:
    marker = f"fogline-forker-{os.getpid()}-{time.monotonic_ns()}"
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(children.guarded([sys.executable, "-c", FORKER, "start", FORKER, marker]),
                              cwd=root, capture_output=True, timeout=20)
        assert done.returncode == 0, done.stderr
        assert _marked(marker) == [], "processes of the tree outlived the guard"
    finally:
        for pid in _marked(marker):  # only processes this test started (its marker)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
