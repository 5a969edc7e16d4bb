"""The demo's children: started in their own sessions, watched, killed on exit whatever happens.

Split from ``simulations.demo`` (issue #31): process supervision, the waits that stop when a
child dies, and the one-line reasons a child stopped, apart from the demo's steps.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime import children

__all__ = ["ChildDied", "Processes", "Terminated", "last_error_line"]


class Processes:
    """Every child of the demo, in its own session, killed on exit whatever happens."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # watched only (each stops its own): name -> (process, its log); a fog broker is a LocalSite
        self.others: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.fatal: dict[str, Path] = {}      # name -> the fatal.json it writes when it gives up
        self.started: dict[str, float] = {}   # name -> wall clock at start (a fatal.json older is stale)
        self.killed: set[str] = set()         # killed on purpose by the demo: not a failure
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, *,
              fatal: Path | None = None, whole_tree: bool = False) -> subprocess.Popen[bytes]:
        proc = children.spawn(argv, log=self.logs / f"{name}.log", env=env, whole_tree=whole_tree)
        self.procs[name] = proc
        self.started[name] = time.time()
        self.killed.discard(name)
        if fatal is not None:
            self.fatal[name] = fatal
        return proc

    def watch(self, name: str, proc: subprocess.Popen[bytes] | None, log: Path) -> None:
        if proc is not None:
            self.others[name] = (proc, log)

    def reason(self, name: str) -> str:
        """Why ``name`` stopped, in its own words: its fatal.json (if written since it started),
        else the last error line of its log."""
        fatal = self.fatal.get(name)
        if fatal is not None:
            try:
                doc = json.loads(fatal.read_text())
                if isinstance(doc, dict) and float(doc.get("at", 0)) >= self.started.get(name, 0) - 1:
                    return _one_line(f"{doc.get('error', 'stopped')} ({fatal})")
            except (OSError, ValueError, TypeError):
                pass
        log = self.others[name][1] if name in self.others else self.logs / f"{name}.log"
        return last_error_line(log)

    def check(self, *names: str) -> None:
        """Raise ``ChildDied`` if one of ``names`` (``prefix*`` for a group) has exited, unless the
        demo killed it on purpose; the message names the child, how it ended, its reason and log."""
        # the fogs first: an agent that exits because its fog died is not the news
        procs = {**{n: p for n, (p, _) in self.others.items()}, **self.procs}
        for name, proc in procs.items():
            if name in self.killed or not any(name == n or (n.endswith("*") and name.startswith(n[:-1]))
                                              for n in names):
                continue
            code = proc.poll()
            if code is not None:
                log = self.others[name][1] if name in self.others else self.logs / f"{name}.log"
                raise ChildDied(f"{name} exited ({_exit_text(code)}): {self.reason(name)} [log {log}]")

    def watching(self, *names: str) -> Callable[[], None]:
        return lambda: self.check(*names)

    def kill9(self, name: str) -> None:
        self.killed.add(name)
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # the whole session, even when its leader is gone: children it spawned (Flower's
            # SuperExec, verify workers) may outlive a SIGTERM to the leader
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait(timeout=5)


def _reap(work: Path, grace_s: float = 3.0) -> None:
    """Whatever still names the demo's directory (Flower's detached SuperExec, which waits to notice
    its SuperLink is gone) gets ``grace_s`` to exit, then SIGKILL: the demo leaves nothing behind."""
    import psutil

    def strays() -> list[Any]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = p.info["cmdline"] or []
                ours = any(k in " ".join(cmd) for k in ("flower-", "flwr", "runtime.cli", "edge_agent", "mosquitto"))
                if p.pid != os.getpid() and ours and any(str(work) in part for part in cmd):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found
    _, alive = psutil.wait_procs(strays(), timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _wait(what: str, cond: Callable[[], Any], timeout: float, poll: float = 0.2,
          watch: Callable[[], None] | None = None) -> Any:
    """Poll ``cond`` until truthy. ``watch`` raises (``ChildDied``) when a child the condition depends
    on has exited: the wait then stops at once with that child's reason instead of timing out."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        past = time.monotonic() >= deadline
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - a process still starting answers with errors
            last_exc = exc
        if watch is not None:
            try:
                watch()
            except ChildDied:
                try:  # the child may have finished its work and exited just now
                    if value := cond():
                        return value
                except Exception:  # noqa: BLE001 - the child's death is the error to report, not this
                    pass
                raise
        if past:
            break
        time.sleep(max(0.0, min(poll, deadline - time.monotonic())))
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}"
                       + (f" (last error: {last_exc})" if last_exc else ""))


class ChildDied(RuntimeError):
    """A child process the demo was waiting on exited; the message carries its own reason."""


def last_error_line(log: Path, max_bytes: int = 64_000) -> str:
    """The line of ``log`` that says why its process stopped: the last one naming an error (a
    traceback's exception line, an ``error:`` line), else the last non-empty one."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError as exc:
        return f"(no log: {exc.strerror or exc})"
    for line in reversed(lines):
        if _ERRORISH.search(line):
            return _one_line(line)
    return _one_line(lines[-1]) if lines else "(empty log)"


_ERRORISH = re.compile(r"error|exception|fatal|critical|traceback|refused|denied|cannot|failed", re.IGNORECASE)


def _one_line(text: str, limit: int = 300) -> str:
    flat = " | ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the demo: it stops like on Ctrl-C (cleanup, then the partial report)."""


def _on_sigterm() -> Any:
    """SIGTERM raises ``Terminated`` in the main thread (elsewhere signals cannot be set: left alone)."""
    def handler(signum: int, frame: Any) -> None:
        raise Terminated("SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(old: Any) -> None:
    if old is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, old)
