"""Plays the fog broker's side for agent tests: FogState, signed commands, verified adverts.

Agents run as real subprocesses (``python -m edge_agent``); every wait has a deadline.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from edge_agent.testing import FogSigner
from runtime import codec
from runtime.errors import RemoteViolation
from runtime.messages import DeviceBirth, Envelope, Message
from runtime.mqtt import Inbound, MqttClient
from runtime.security import TrustStore, Verifier
from runtime.topics import CMD, Topics, parse

REPO = Path(__file__).resolve().parents[2]


class FogSide:
    """An MQTT client that publishes the fog STATE and commands and records device adverts."""

    def __init__(self, broker: Any, site: str = "default", fog_id: str = "fog-test",
                 fog: FogSigner | None = None) -> None:
        self.topics = Topics(site)
        self.fog = fog or FogSigner(fog_id, site)
        self.trust = TrustStore()
        self.verifier = Verifier(self.trust)
        self.events: queue.Queue[tuple[float, str, str, Message]] = queue.Queue()
        self.seen: list[tuple[float, str, str, Message]] = []
        self.unverified = 0
        self.client = MqttClient(f"{fog_id}-{os.getpid()}-{time.monotonic_ns() % 100000}", broker.host, broker.port)
        self.client.subscribe(self.topics.all_devices("+"), self._on_msg)
        self.client.subscribe(self.topics.reply("+"), self._on_msg)
        self.client.start()
        assert self.client.wait_connected(5)

    def close(self) -> None:
        self.client.stop()

    def _on_msg(self, m: Inbound) -> None:
        try:
            msg = codec.decode(m.payload)
            if isinstance(msg, Envelope):
                inner = codec.decode(msg.payload)
                if isinstance(inner, DeviceBirth) and msg.sender not in self.trust:
                    self.trust.enroll(msg.sender, inner.public_key)  # TOFU, as the fog broker does
                msg = self.verifier.check(msg, time.time())
        except RemoteViolation:
            self.unverified += 1
            return
        p = parse(m.topic)
        self.events.put((m.received_at, p.name, p.leaf, msg))

    def online(self, epoch: int = 1, online: bool = True) -> None:
        assert self.client.publish(self.topics.fog_state(), self.fog.fog_state(online, epoch), retain=True).wait(5)

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


def spawn_agent(broker: Any, device_id: str, data_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "edge_agent", "--broker", broker.address, "--id", device_id,
           "--data-dir", str(data_dir), "--keepalive", "2", "--threads", "1", *extra]
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
    deadline = time.monotonic() + timeout
    st = status(data_dir)
    while not pred(st):
        if time.monotonic() > deadline:
            raise AssertionError(f"status never matched: {st}")
        time.sleep(0.05)
        st = status(data_dir)
    return st
