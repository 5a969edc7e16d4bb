"""Plays the fog broker's side for agent tests: sealed FogState, signed commands, verified adverts.

Agents run as real subprocesses (``python -m edge_agent``) on a plain loopback
mosquitto, pinning the test fog's key with ``--fog-key HEX --insecure``; every
wait has a deadline. ``EnrolServer`` is a small HTTPS server that follows the
enrolment contract of docs/security.md, for the enrolment tests.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_agent.testing import FogSigner
from runtime import codec
from runtime.errors import RemoteViolation
from runtime.messages import Activation, DeviceBirth, DeviceDeath, Envelope, Message
from runtime.mqtt import Inbound, MqttClient
from runtime.security import TrustStore, Verifier
from runtime.topics import ACT, CMD, DEATH, Topics, parse

from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


class FogSide:
    """An MQTT client that publishes the fog STATE and commands and records device adverts."""

    def __init__(self, broker: Any, site: str = "default", fog_id: str = "fog-test",
                 fog: FogSigner | None = None, tls: Any = None) -> None:
        self.topics = Topics(site)
        self.fog = fog or FogSigner(fog_id, site)
        self.trust = TrustStore()
        self.verifier = Verifier(self.trust)
        self.events: queue.Queue[tuple[float, str, str, Message]] = queue.Queue()
        self.seen: list[tuple[float, str, str, Message]] = []
        self.unverified = 0
        self.raw_deaths: list[bytes] = []  # DEATH payloads as received (the finding-6 tests check them)
        self.client = MqttClient(f"{fog_id}-{os.getpid()}-{time.monotonic_ns() % 100000}", broker.host, broker.port,
                                 tls=tls)
        self.client.subscribe(self.topics.all_devices("+"), self._on_msg)
        self.client.subscribe(self.topics.reply("#"), self._on_msg)  # results: reply/{client}/{device}
        self.client.start()
        assert self.client.wait_connected(5)

    def close(self) -> None:
        self.client.stop()

    def _on_msg(self, m: Inbound) -> None:
        p = parse(m.topic)
        if p.leaf in (CMD, ACT):
            return  # our own commands and the data plane (checked by the devices themselves)
        try:
            msg = codec.decode(m.payload)
            if isinstance(msg, Envelope):
                inner = codec.decode(msg.payload)
                if isinstance(inner, DeviceBirth) and msg.sender not in self.trust:
                    self.trust.enroll(msg.sender, inner.public_key)  # the test fog learns device keys from births
                if p.leaf == DEATH or p.scope == "reply":
                    # deaths are sealed when the Will is set (old by design) and results are checked
                    # by signature and route, not by a window: signature only
                    self.verifier.verify_signature(msg)
                    msg = inner
                else:
                    msg = self.verifier.check(msg, time.time())
            elif isinstance(msg, DeviceDeath):
                self.unverified += 1  # deaths must be sealed by the device (finding 6)
                return
        except RemoteViolation:
            self.unverified += 1
            return
        if p.leaf == DEATH:
            self.raw_deaths.append(m.payload)
        self.events.put((m.received_at, p.name, p.leaf, msg))

    def online(self, epoch: int = 1, online: bool = True) -> None:
        assert self.client.publish(self.topics.fog_state(), self.fog.fog_state(online, epoch), retain=True).wait(5)

    def send_activation(self, act: Activation) -> None:
        """Hop 0 as the fog sends it: a relay frame with this fog's signed route ticket."""
        keys = {n: k for n in self.trust.names() if (k := self.trust.key_bytes(n)) is not None}
        assert self.client.publish(self.topics.activation(act.route[0].device_id, self.fog.fog_id),
                                   self.fog.frame(act, keys)).wait(5)

    def command(self, device: str, msg: Message) -> None:
        self.raw(device, self.fog.seal(msg))

    def raw(self, device: str, payload: bytes) -> None:
        assert self.client.publish(self.topics.device(device, CMD), payload).wait(5)

    def wait(self, pred: Callable[[str, str, Message], bool], timeout: float = 10.0) -> tuple[float, str, str, Message]:
        """The first recorded or new event matching ``pred`` (device, leaf, message)."""
        for ev in self.seen:
            if pred(ev[1], ev[2], ev[3]):
                self.seen.remove(ev)
                return ev
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout} s; saw {[(e[1], e[2], e[3].KIND) for e in self.seen]}")
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if pred(ev[1], ev[2], ev[3]):
                return ev
            self.seen.append(ev)

    def wait_leaf(self, device: str, leaf: str, timeout: float = 10.0,
                  cond: Callable[[Any], bool] = lambda m: True) -> Any:
        return self.wait(lambda d, lf, m: d == device and lf == leaf and cond(m), timeout)[3]


def spawn_agent(broker: Any, device_id: str, data_dir: Path, *extra: str,
                fog: FogSigner | None = None) -> subprocess.Popen[bytes]:
    """``python -m edge_agent`` pinning ``fog``'s key on a plain loopback broker (no key flags if None)."""
    cmd = [sys.executable, "-m", "edge_agent", "--broker", broker.address, "--id", device_id,
           "--data-dir", str(data_dir), "--keepalive", "2", "--threads", "1",
           *(fog.agent_args() if fog is not None else ()), *extra]
    log = open(data_dir.parent / f"{device_id}.log", "wb")  # noqa: SIM115 - closed by the child's exit
    data_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)


def status(data_dir: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((data_dir / "status.json").read_text()))
    except (OSError, ValueError):
        return {}


def wait_status(data_dir: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
    return wait_for(lambda: st if pred(st := status(data_dir)) else None, timeout,
                    lambda: f"an agent status matching: {status(data_dir)}")


def run_agent_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``python -m edge_agent ARGS`` to completion (for refusals: exit code 2 and one line)."""
    return subprocess.run([sys.executable, "-m", "edge_agent", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    """The non-log lines of an agent's stderr (log records carry a level name)."""
    return [ln for ln in stderr.splitlines()
            if ln.strip() and not any(f" {lv} " in ln for lv in ("DEBUG", "INFO", "WARNING", "ERROR"))]
