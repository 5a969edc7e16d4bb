"""Helpers of tests/integration/test_chaos.py: named real processes, bounded waits, an open-loop client.

Every child runs in its own session (``start_new_session``) so that ``kill9``
(``killpg`` SIGKILL) takes its whole tree (the fog broker's verify workers, the
coordinator's SuperLink and ServerApp) and nothing else. ``close`` kills all of
them, and the mosquitto a fog broker left running (found from its
``mqtt/owner.json``).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import waiting

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
VENV_BIN = Path(sys.executable).parent


def base_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
                "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1", "FOGLINE_CACHE_DIR": str(tmp / "cache")})
    return env


def wait_for(what: str, cond: Callable[[], Any], timeout: float, poll: float = 0.2) -> Any:
    """``waiting.wait_for`` in this harness's old argument order; exceptions count as 'not yet'.

    Kept only for callers not yet moved (tests/security/test_flood_identity.py): new code uses
    ``from waiting import wait_for``.
    """
    return waiting.wait_for(cond, timeout, what, interval=poll, retry_on=Exception)


class Procs:
    """Named subprocesses of one test, each in its own session; all killed in ``close``."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.env = env
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.history: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              stdout_pipe: bool = False) -> subprocess.Popen[bytes]:
        old = self.procs.get(name)
        assert old is None or old.poll() is not None, f"{name} is still running"
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(list(argv), cwd=ROOT, env=env or self.env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if stdout_pipe else log,
                                    stderr=log if stdout_pipe else subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.procs[name] = proc
        self.history.append(proc)
        return proc

    def kill9(self, name: str) -> None:
        """kill -9 of the process group (the process and every child it started in its session)."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.logs / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        for owner in self.tmp.glob("**/mqtt/owner.json"):  # a mosquitto a fog broker started (own session)
            try:
                os.kill(int(json.loads(owner.read_text())["pid"]), signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass
        for p in self.history:  # the whole session, even when its leader is gone: a ClientApp
            try:                  # outlives a SuperNode that died on its own
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.history:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()


def read_ready(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """The fog broker's one JSON line on stdout (``{"event": "ready", ...}``), bounded."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        line = proc.stdout.readline().decode()
        if not line:
            break  # EOF: the process died
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == "ready":
            return doc  # type: ignore[no-any-return]
    raise AssertionError(f"fog broker not ready within {timeout:g} s (exit code {proc.poll()})")


# ------------------------------------------------------------------ open-loop inference client


@dataclass
class Outcome:
    seq: int
    sent_at: float            # monotonic, just before publish
    done_at: float
    kind: str                 # "ok" | "error" | "timeout" | "exception"
    input_index: int
    error: str = ""
    replica: int | None = None
    max_diff: float | None = None


@dataclass
class OpenLoop:
    """Requests at a fixed rate, each in its own worker thread (open loop: a slow answer delays nothing)."""

    client: Any
    workload: str
    inputs: list[dict[str, np.ndarray]]
    references: list[dict[str, np.ndarray]]
    rate: float
    request_timeout: float
    workers: int = 96
    outcomes: list[Outcome] = field(default_factory=list)
    sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _pool: ThreadPoolExecutor | None = None

    def start(self) -> OpenLoop:
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="chaos-req")
        self._thread = threading.Thread(target=self._pace, name="chaos-pacer", daemon=True)
        self._thread.start()
        return self

    def _pace(self) -> None:
        assert self._pool is not None
        pace = 1.0 / self.rate
        nxt = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            nxt += pace
            delay = nxt - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            self._pool.submit(self._one, seq)
            with self._lock:
                self.sent += 1
            seq += 1

    def _one(self, seq: int) -> None:
        i = seq % len(self.inputs)
        t0 = time.monotonic()
        try:
            res = self.client.infer_result(self.workload, self.inputs[i], timeout=self.request_timeout)
        except TimeoutError as exc:
            out = Outcome(seq, t0, time.monotonic(), "timeout", i, str(exc))
        except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
            out = Outcome(seq, t0, time.monotonic(), "exception", i, repr(exc))
        else:
            if res.ok:
                ref = self.references[i]
                try:
                    diff = max(float(np.max(np.abs(np.asarray(res.tensors[k], dtype=np.float64) - v)))
                               for k, v in ref.items())
                except KeyError as exc:
                    out = Outcome(seq, t0, time.monotonic(), "exception", i, f"missing output {exc}")
                else:
                    out = Outcome(seq, t0, time.monotonic(), "ok", i, replica=res.replica, max_diff=diff)
            else:
                out = Outcome(seq, t0, time.monotonic(), "error", i, res.error or "(no reason)",
                              replica=res.replica)
        with self._lock:
            self.outcomes.append(out)

    def stop(self, drain_timeout: float) -> None:
        """Stop sending; wait (bounded) for every request in flight to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=False)
            deadline = time.monotonic() + drain_timeout
            while time.monotonic() < deadline:
                with self._lock:
                    if len(self.outcomes) >= self.sent:
                        return
                time.sleep(0.1)


def new_site() -> str:
    return f"chaos{uuid.uuid4().hex[:6]}"
