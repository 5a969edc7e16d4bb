"""What every MQTT broker we launch shares: the child-process handle and the port helpers.

Both ``runtime.broker`` (mosquitto) and ``runtime.fallback_broker`` (the zero-install one) build
on it; it imports neither, so the two do not import each other.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time

__all__ = ["BrokerProcess", "free_port", "port_open", "wait_port"]


def free_port(host: str = "127.0.0.1") -> int:
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
