"""What every MQTT broker we launch shares: the child-process handle and the port helpers.

Both ``runtime.broker`` (mosquitto) and ``runtime.fallback_broker`` (the zero-install one) build
on it; it imports neither, so the two do not import each other.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time

__all__ = ["BrokerProcess", "free_port", "port_open", "wait_port"]


#: ``LO-HI``: pick free ports in this range instead of the kernel's ephemeral one. Parallel test
#: workers each get their own range below the ephemeral ports (tests/conftest.py), so a port one
#: worker picked and has not bound yet is never another's pick, nor the source port of a connection.
PORT_RANGE_ENV = "FOGLINE_PORT_RANGE"


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and the one above it free too (a fog serves enrolment on port + 1)."""
    span = os.environ.get(PORT_RANGE_ENV, "")
    if span:
        lo, _, hi = span.partition("-")
        first, last = int(lo), int(hi) - 2  # p + 1 stays inside the range too
        rng = random.Random()
        for _ in range(200):
            p = rng.randint(first, last)
            if _bindable(host, p) and _bindable(host, p + 1):
                return p
        raise OSError(f"no two free ports next to each other in {PORT_RANGE_ENV}={span}")
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


class BrokerProcess:
    """What every broker we launch offers: a child process we can check, stop or kill."""

    host: str
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> BrokerProcess:
        raise NotImplementedError

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests use it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=5)
        self._exited()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._exited()

    def _exited(self) -> None:
        """Release what the child held (subclasses)."""

    def __enter__(self) -> BrokerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
