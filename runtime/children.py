"""Child processes that never outlive the process that started them (one place for it).

Every child Fogline starts — mosquitto, Flower's SuperLink, SuperNodes and runs, agents in a
demo — is started here. On Linux the child asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), so even a ``kill -9`` of the parent leaves no orphan behind. Two
caveats the kernel imposes, handled here:

* the signal follows the *thread* that forked, not the process: a child asked for from any
  thread but the main one is forked by one spawner thread that lives as long as the process,
  so a short-lived worker thread that starts a child does not take the child with it;
* a change of user or group clears the setting: a child that must run unprivileged is
  switched to its user here, *before* the setting is made (``user=``), instead of dropping
  privileges itself (as mosquitto's ``user`` option would).

If the parent died between ``fork`` and the ``prctl`` call, the child exits at once.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

__all__ = ["die_with_parent_preexec", "guarded", "spawn", "stop", "stop_all", "alive"]

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent: after a change of user the child may not be able to
    import anything (the interpreter's files can be unreadable to that user)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        return None


def guarded(argv: Sequence[str]) -> list[str]:
    """``argv`` run under ``runtime.guard`` (this interpreter): its whole tree ends with us."""
    return [sys.executable, "-m", "runtime.guard", "--", *argv]


def die_with_parent_preexec(*, user: str | None = None,
                            sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that drops to ``user`` (when root) and then asks for ``sig`` on parent death.

    None off Linux (there is no such kernel feature: the caller's own cleanup has to do).
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    prctl = _prctl()
    ids: tuple[int, int] | None = None
    if user is not None and os.geteuid() == 0:
        import pwd

        pw = pwd.getpwnam(user)
        ids = (pw.pw_uid, pw.pw_gid)

    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        if ids is not None:
            os.setgroups([])
            os.setgid(ids[1])
            os.setuid(ids[0])
        if prctl is None or prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # the parent died before the request was made
            os._exit(1)

    return preexec


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
          log: Path | IO[bytes] | int | None = None, stdin: int | IO[bytes] | None = subprocess.DEVNULL,
          stdout: int | IO[bytes] | None = None, user: str | None = None, own_session: bool = True,
          die_with_parent: bool = True, whole_tree: bool = False, **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``argv``; it dies with this process (unless ``die_with_parent=False``).

    ``whole_tree``: so do the processes ``argv`` starts itself, which the kernel's parent-death
    signal does not reach (Flower's SuperNode and its ClientApps): ``argv`` runs under
    ``runtime.guard``, which watches this process and takes the whole tree down with it.

    ``log``: a path (appended to; the child keeps the descriptor) or an open file that gets
    stdout and stderr. ``own_session``: the child gets its own session, so a Ctrl-C meant for
    the parent's terminal does not reach it before the parent has decided how to stop it.
    """
    out: Any = stdout
    err: Any = popen.pop("stderr", None)
    with contextlib.ExitStack() as opened:  # a log opened here closes once the child has its copy
        if log is not None:
            if isinstance(log, (str, Path)):
                out, err = opened.enter_context(open(log, "ab")), subprocess.STDOUT
            else:
                out, err = log, subprocess.STDOUT
        if whole_tree and die_with_parent:
            argv, die_with_parent = guarded(argv), False  # the guard watches us instead
        preexec = die_with_parent_preexec(user=user) if die_with_parent else None

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(list(argv), env=dict(env) if env is not None else None,
                                    cwd=str(cwd) if cwd is not None else None, stdin=stdin,
                                    stdout=out, stderr=err, start_new_session=own_session,
                                    preexec_fn=preexec, **popen)

        if preexec is None or threading.current_thread() is threading.main_thread():
            return start()
        return _Spawner.run(start)


class _Spawner:
    """The one thread that forks children asked for from other threads (see the module docstring)."""

    _lock = threading.Lock()
    _jobs: queue.SimpleQueue[tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]] = (
        queue.SimpleQueue())
    _thread: threading.Thread | None = None

    @classmethod
    def run(cls, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with cls._lock:
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._loop, name="fogline-spawner", daemon=True)
                cls._thread.start()
        fut: Future[subprocess.Popen[bytes]] = Future()
        cls._jobs.put((start, fut))
        return fut.result()

    @classmethod
    def _loop(cls) -> None:
        while True:
            start, fut = cls._jobs.get()
            try:
                fut.set_result(start())
            except BaseException as exc:  # noqa: BLE001 - the caller re-raises it; this thread lives on
                fut.set_exception(exc)


def alive(proc: subprocess.Popen[bytes] | None) -> bool:
    return proc is not None and proc.poll() is None


def stop(proc: subprocess.Popen[Any] | None, timeout_s: float = 5.0, *, group: bool = False) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code (None if there was no child).

    ``group``: signal the child's whole process group (a child started with ``own_session``
    that has children of its own).
    """
    if proc is None:
        return None
    if proc.poll() is None:
        _signal(proc, signal.SIGTERM, group)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            _signal(proc, signal.SIGKILL, group)
    try:
        return proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:  # pragma: no cover - a process in uninterruptible sleep
        return None
    finally:
        if group:  # what the leader started may outlive it (Flower's ClientApp after its SuperNode)
            _signal(proc, signal.SIGKILL, True)


def stop_all(procs: Iterable[subprocess.Popen[Any] | None], timeout_s: float = 5.0, *,
             group: bool = False) -> None:
    """``stop`` for several children at once: all get SIGTERM first, then share one deadline."""
    live = [p for p in procs if p is not None]
    for p in live:
        if p.poll() is None:
            _signal(p, signal.SIGTERM, group)
    deadline = time.monotonic() + timeout_s
    for p in live:
        stop(p, max(0.0, deadline - time.monotonic()), group=group)


def _signal(proc: subprocess.Popen[Any], sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass
