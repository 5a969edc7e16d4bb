"""A process tree that ends with its parent: ``python -m runtime.guard -- COMMAND ...``
(``runtime.children.spawn(..., whole_tree=True)`` starts a command this way).

``PR_SET_PDEATHSIG`` (``runtime.children``) kills the one child it is set on. Some children
start processes of their own that we do not control: Flower's SuperNode starts a ClientApp per
run, the SuperLink a SuperExec and ServerApps. When such a child is killed, its children are
reparented to init and run on (an orphan ClientApp holds its node's work; an orphan ServerApp
the work directory's lock). The guard sits between: it is the "child subreaper" of everything
below it, so nothing under it can slip away to init, and it kills that whole tree when its own
parent dies (kill -9 included: it watches, it is not told) or when the command itself ends.
SIGTERM and SIGINT are passed to the command, whose exit code the guard exits with.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from runtime import children

__all__ = ["subreaper", "process_table", "descendants", "kill_descendants",
           "take_descendants_when_parent_dies"]

_PR_SET_CHILD_SUBREAPER = 36


def subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def process_table() -> dict[int, tuple[int, str]]:
    """Every process's parent and state, from /proc: pid -> (ppid, state)."""
    out: dict[int, tuple[int, str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            state, ppid = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            out[int(d)] = (int(ppid), state)
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(root: int | None = None) -> list[int]:
    """Live (not zombie) descendants of ``root`` (this process), nearest first."""
    root = os.getpid() if root is None else root
    table = process_table()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found, todo = [], list(kids.get(root, []))
    while todo:
        pid = todo.pop(0)
        if table.get(pid, (0, "Z"))[1] != "Z":
            found.append(pid)
        todo.extend(kids.get(pid, []))
    return found


def kill_descendants(root: int | None = None, deadline_s: float = 10.0) -> int:
    """SIGKILL every descendant of ``root``, pass after pass until none is left (a tree that keeps
    forking grows between a pass's read of /proc and its kills: one pass once left 8 behind);
    how many were signalled. Gives up after ``deadline_s`` (a pid we may not kill)."""
    signalled: set[int] = set()
    end = time.monotonic() + deadline_s
    while (pids := descendants(root)) and time.monotonic() < end:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                signalled.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return len(signalled)


def take_descendants_when_parent_dies(interval_s: float = 0.25) -> None:
    """Watch the parent from a thread; when it is gone, kill -9 every descendant, then exit.

    For a process that is itself the parent of processes it does not control (the SuperLink's
    SuperExec): it must run without a parent-death signal, which would kill it alone.
    """
    parent = os.getppid()
    subreaper()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        kill_descendants()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("error: usage: python -m runtime.guard -- COMMAND ...", file=sys.stderr)
        return 2
    take_descendants_when_parent_dies()
    try:
        # the command dies with the guard even if the guard is killed itself
        proc = children.spawn(args, stdin=None, own_session=False)
    except OSError as exc:
        print(f"error: cannot start {args[0]}: {exc}", file=sys.stderr)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    code = proc.wait()
    kill_descendants()  # what the command started and left behind
    while True:  # reap them (we are their reaper now)
        try:
            if os.waitpid(-1, 0)[0] <= 0:
                break
        except ChildProcessError:
            break
        except InterruptedError:  # pragma: no cover
            continue
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
