"""The files a run keeps in its work directory for the supervisor and ``fogline status``.

``RobustStrategy``'s I/O collaborator: the lock (one run per directory: a stale ServerApp still dying
must not write over a new one), the heartbeat (``progress.json``, what the watchdog and ``fogline status
--coordinator`` read), the one-line failure (``fatal.json``: bad input, no restart can help) and the
report (``report.json``, written once every round is done).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.errors import FoglineError

from .settings import FATAL_FILE, PROGRESS_FILE, REPORT_FILE
from .store import atomic_write

__all__ = ["RunFailed", "LOCK_FILE", "lock_work_dir", "write_progress", "record_failure", "write_report"]

log = logging.getLogger("fogline.strategy")
LOCK_FILE = ".coordinator.lock"
LOCK_WAIT_S = 60.0


class RunFailed(FoglineError):
    """Bad input stopped the run (f too large for the clients, an export hook, a checkpoint quorum)."""


def lock_work_dir(work_dir: Path) -> int:
    """An exclusive lock on ``work_dir`` (its descriptor; close it to release), waiting a bounded time for a
    stale run to die; ``RunFailed`` when another run still holds it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RunFailed(f"{work_dir} is locked by another coordinator run") from None
            time.sleep(0.5)


def write_progress(work_dir: Path, doc: Mapping[str, Any]) -> None:
    """The heartbeat; a failed write is logged (the next round writes it again), never the run's end."""
    try:
        atomic_write(work_dir / PROGRESS_FILE, json.dumps(doc).encode())
    except OSError as exc:
        log.warning("cannot write %s: %s", PROGRESS_FILE, exc)


def record_failure(work_dir: Path | None, text: str, trace: str = "") -> RunFailed:
    """Record a run-stopping bad input for the supervisor (one line) and return the error to raise."""
    if work_dir is not None:
        doc: dict[str, Any] = {"error": text, "at": time.time()}
        if trace:
            doc["traceback"] = trace
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(work_dir / FATAL_FILE, json.dumps(doc).encode())
        except OSError as exc:
            log.error("cannot record the failure in %s: %s", work_dir, exc)
    log.error("%s", text)
    return RunFailed(text)


def write_report(work_dir: Path, doc: Mapping[str, Any]) -> None:
    atomic_write(work_dir / REPORT_FILE, json.dumps(doc, indent=1, default=float).encode())
